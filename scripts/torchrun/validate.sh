#!/usr/bin/env bash
# Multi-node `stackproof validate` through torchrun, configured from the environment: run this once on every
# node. It maps the variables below onto validate's own flags (python -m stackproof validate --help) and execs
# it; every argument goes to validate (e.g. -k collectives --timeout 120).
#
#   single node:     scripts/torchrun/validate.sh
#   static ranks:    NNODES=2 NODE_RANK=0 MASTER_ADDR=node-a scripts/torchrun/validate.sh     # on node-a
#                    NNODES=2 NODE_RANK=1 MASTER_ADDR=node-a scripts/torchrun/validate.sh     # on node-b
#   c10d rendezvous: NNODES=2 RDZV_ENDPOINT=node-a:29400 scripts/torchrun/validate.sh       # on both, any order
#
# Env (all optional): NNODES -> --nnodes, NODE_RANK -> --node-rank, MASTER_ADDR/MASTER_PORT -> --master-addr/
# --master-port, RDZV_ENDPOINT -> --rdzv-endpoint, RDZV_ID -> --rdzv-id (default: the Slurm job id, if any),
# RDZV_TIMEOUT_S -> --rendezvous-timeout, RUN_TIMEOUT_S -> --run-timeout, EXPECT_GPUS -> --expect-gpus,
# NPROC_PER_NODE -> --nproc (CPU ranks when the node has no GPU); STACKPROOF_PYTHON: the interpreter with torch
# and stackproof (default python3). Exit code: validate's (0 passed, 1 a check failed, 2 bad input, 3 no GPU,
# 4 incomplete, 5 interrupted).
set -euo pipefail

# Run from a checkout without installing: put the repository on PYTHONPATH (images already have it there).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/../../stackproof/__init__.py" ]; then
    repo="$(cd "$here/../.." && pwd)"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi

flags=()
add() { if [ -n "${2:-}" ]; then flags+=("$1" "$2"); fi; }
add --nnodes "${NNODES:-}"
add --node-rank "${NODE_RANK:-}"
add --master-addr "${MASTER_ADDR:-}"
add --master-port "${MASTER_PORT:-}"
add --rdzv-endpoint "${RDZV_ENDPOINT:-}"
add --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-}}"
add --rendezvous-timeout "${RDZV_TIMEOUT_S:-}"
add --run-timeout "${RUN_TIMEOUT_S:-}"
add --expect-gpus "${EXPECT_GPUS:-}"
add --nproc "${NPROC_PER_NODE:-}"
# This script is the launcher: torchrun's own variables must not make validate believe it is a rank already.
unset RANK WORLD_SIZE LOCAL_RANK
exec "${STACKPROOF_PYTHON:-python3}" -m stackproof validate "${flags[@]}" "$@"
