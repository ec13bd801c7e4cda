#!/usr/bin/env bash
# Multi-node `stackproof validate` through torchrun: run this once on every node; every argument goes to
# `python -m stackproof validate` (e.g. -k collectives --timeout 120).
#
#   single node:     scripts/torchrun/validate.sh
#   static ranks:    NNODES=2 NODE_RANK=0 MASTER_ADDR=node-a scripts/torchrun/validate.sh     # on node-a
#                    NNODES=2 NODE_RANK=1 MASTER_ADDR=node-a scripts/torchrun/validate.sh     # on node-b
#   c10d rendezvous: NNODES=2 RDZV_ENDPOINT=node-a:29400 scripts/torchrun/validate.sh       # on both, any order
#
# Env (all optional):
#   NNODES           nodes in the run (default 1; "MIN:MAX" is not supported: a validation needs a fixed world)
#   NPROC_PER_NODE   ranks per node (default: the GPUs this node sees; 1 CPU rank (gloo) when it sees none)
#   EXPECT_GPUS      GPUs this node must see, else exit 3 (default: >= 1 when NVIDIA_VISIBLE_DEVICES names
#                    devices, as in stackproof's images; EXPECT_GPUS=0 validates on CPU on purpose)
#   NODE_RANK + MASTER_ADDR [+ MASTER_PORT, default 29500]: static rendezvous, ranks by node order
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (any node, usually the first); RDZV_ID names the run
#                    (default stackproof, or the Slurm job id): nodes join whichever run has their id
#   RDZV_TIMEOUT_S   seconds to wait for every node to join (default 300): a missing node fails the run
#   RUN_TIMEOUT_S    seconds the whole run may take on this node (default 1800): then every rank is stopped
#   STACKPROOF_PYTHON  the interpreter that has torch and stackproof (default python3)
#   STACKPROOF_REPORTS where reports go (default ./reports; --reports in the arguments wins)
#
# Exit code: report.json's when this node holds it (rank 0's node, or every node on a shared filesystem):
# 0 passed, 1 a check failed, 3 no GPU, 4 a rank died or timed out; otherwise 4 when a rank on this node died
# or a rendezvous/run timed out, else 0.
set -euo pipefail

NNODES="${NNODES:-1}"
RDZV_TIMEOUT_S="${RDZV_TIMEOUT_S:-300}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-1800}"
PYTHON="${STACKPROOF_PYTHON:-python3}"
KILL_GRACE_S=30

log() { printf '# stackproof torchrun: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

case "$NNODES" in ''|*[!0-9]*|0) die "NNODES=$NNODES: expected a whole number of nodes >= 1" ;; esac
for var in RDZV_TIMEOUT_S RUN_TIMEOUT_S; do
    case "${!var}" in ''|*[!0-9]*|0) die "$var=${!var}: expected whole seconds > 0" ;; esac
done

# Run from a checkout without installing: put the repository on PYTHONPATH (images already have it there).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/../../stackproof/__init__.py" ]; then
    repo="$(cd "$here/../.." && pwd)"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    # Set but empty or "-1" hides every GPU.
    gpus="$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -cvE '^\s*(-1)?\s*$' || true)"
elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
else
    gpus=0
fi
# GPUs this node must see, as `stackproof validate` decides it: EXPECT_GPUS, else >= 1 in a container started
# for GPUs (NVIDIA_VISIBLE_DEVICES names devices). Ranks that see none would run on CPU and pass.
want="${EXPECT_GPUS:-}"
if [ -z "$want" ] && [ -n "${NVIDIA_VISIBLE_DEVICES:-}" ]; then
    case "$NVIDIA_VISIBLE_DEVICES" in void|none|VOID|NONE) ;; *) want=1 ;; esac
fi
if [ -n "$want" ] && [ "$gpus" -lt "$want" ]; then
    log "this node sees $gpus GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}), expected $want (EXPECT_GPUS / NVIDIA_VISIBLE_DEVICES=${NVIDIA_VISIBLE_DEVICES-unset}); EXPECT_GPUS=0 validates on CPU on purpose"
    log "Verdict: FAILED (exit code 3: no GPU visible, but GPUs were expected)"
    exit 3
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE="$gpus"
    [ "$gpus" -gt 0 ] || NPROC_PER_NODE=1
fi
case "$NPROC_PER_NODE" in ''|*[!0-9]*|0) die "NPROC_PER_NODE=$NPROC_PER_NODE: expected a whole number >= 1" ;; esac

# Where rank 0 writes report.json: the last --reports in the arguments, else $STACKPROOF_REPORTS, else ./reports.
reports="${STACKPROOF_REPORTS:-reports}"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        --reports=*) reports="${args[i]#--reports=}" ;;
        --reports) reports="${args[i + 1]:-$reports}" ;;
        --) break ;;
    esac
done

rdzv=()
if [ -n "${RDZV_ENDPOINT:-}" ]; then
    # Dynamic: the node whose address matches the endpoint hosts the store; node ranks come in join order.
    rdzv=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
          --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-stackproof}}"
          --rdzv-conf="join_timeout=$RDZV_TIMEOUT_S,read_timeout=$RDZV_TIMEOUT_S,close_timeout=60")
    how="c10d rendezvous at $RDZV_ENDPOINT"
elif [ -n "${NODE_RANK:-}" ]; then
    [ -n "${MASTER_ADDR:-}" ] || die "NODE_RANK is set but MASTER_ADDR is not: the static rendezvous needs node 0's address"
    case "$NODE_RANK" in *[!0-9]*) die "NODE_RANK=$NODE_RANK: expected 0..$((NNODES - 1))" ;; esac
    [ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK: expected 0..$((NNODES - 1))"
    rdzv=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR"
          --master-port="${MASTER_PORT:-29500}" --rdzv-conf="timeout=$RDZV_TIMEOUT_S")
    how="static rendezvous at $MASTER_ADDR:${MASTER_PORT:-29500}, node rank $NODE_RANK"
elif [ "$NNODES" = 1 ]; then
    rdzv=(--standalone --nnodes=1)
    how="standalone (one node)"
else
    die "NNODES=$NNODES needs RDZV_ENDPOINT=host:port (c10d) or NODE_RANK + MASTER_ADDR (static)"
fi

log "$NNODES node(s) x $NPROC_PER_NODE rank(s), $how; rendezvous timeout ${RDZV_TIMEOUT_S}s, run timeout ${RUN_TIMEOUT_S}s; reports: $reports"

mkdir -p "$reports"
# A stale verdict must not pass for this run's (on a shared filesystem every node clears it before any rank
# can start: rank 0 writes only after every node has joined).
rm -f "$reports/report.json"

# STACKPROOF_LAUNCHED: a rank returns 0 for "checks ran" (passed or failed) so torchrun does not stop rank 0
# before it writes the verdict; the verdict comes from report.json below, as `stackproof validate` does.
rc=0
STACKPROOF_LAUNCHED=1 timeout --kill-after="$KILL_GRACE_S" "$RUN_TIMEOUT_S" \
    "$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node="$NPROC_PER_NODE" \
    --max-restarts=0 --monitor-interval=1 \
    -m stackproof validate "$@" || rc=$?

verdict=""
if [ -f "$reports/report.json" ]; then
    verdict="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_code"])' \
        "$reports/report.json" 2>/dev/null || true)"
fi
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    log "the run exceeded RUN_TIMEOUT_S=${RUN_TIMEOUT_S}s on this node and was stopped; rank logs: $reports/logs/"
    exit 4
fi
if [ -n "$verdict" ] && [ "$verdict" != 0 ]; then
    exit "$verdict"
fi
if [ "$rc" != 0 ]; then
    log "torchrun exited $rc: a rank died or a rendezvous timed out (torchrun's summary above names it); rank logs: $reports/logs/"
    exit 4
fi
if [ -n "$verdict" ]; then
    exit "$verdict"
fi
log "torchrun finished; this node holds no report.json (rank 0 ran on another node: its report has the verdict)"
exit 0
