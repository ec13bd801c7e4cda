#!/usr/bin/env bash
# Submit scripts/slurm/validate.sbatch with the job's shape taken from variables, wait for it, and exit with
# its exit code. Every argument goes to `stackproof validate`.
#
#   NODES=2 GPUS_PER_NODE=8 scripts/slurm/submit.sh                         # 16 ranks, one per GPU
#   NODES=2 GPUS_PER_NODE=8 STACKPROOF_IMAGE=registry#stackproof/x:tag scripts/slurm/submit.sh   # pyxis
#   NODES=2 GPUS_PER_NODE=0 TASKS_PER_NODE=1 scripts/slurm/submit.sh -k collectives   # CPU ranks (gloo)
#
# Env: NODES (default 1), GPUS_PER_NODE (default 8; 0 = no GPU requested), TASKS_PER_NODE (default
# GPUS_PER_NODE, or 1 without GPUs; with STACKPROOF_LAUNCH=torchrun the job still holds that many tasks per
# node, the step runs one torchrun per node), CPUS_PER_TASK (sbatch -c: CPUs per rank, for the ResNet step and
# DataLoader workers; Slurm's default is often 1), TIME_LIMIT (sbatch --time, default 00:45:00), PARTITION,
# ACCOUNT, SBATCH_EXTRA (more sbatch flags, split on spaces), NO_WAIT=1 (print the job id and return).
# The STACKPROOF_* variables of validate.sbatch pass through (sbatch exports the environment).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODES="${NODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
if [ "$GPUS_PER_NODE" -gt 0 ]; then TASKS_PER_NODE="${TASKS_PER_NODE:-$GPUS_PER_NODE}"; else TASKS_PER_NODE="${TASKS_PER_NODE:-1}"; fi
TIME_LIMIT="${TIME_LIMIT:-00:45:00}"

args=(--nodes="$NODES" --ntasks-per-node="$TASKS_PER_NODE" --time="$TIME_LIMIT")
[ "$GPUS_PER_NODE" -eq 0 ] || args+=(--gpus-per-node="$GPUS_PER_NODE")
[ -z "${CPUS_PER_TASK:-}" ] || args+=(--cpus-per-task="$CPUS_PER_TASK")
[ -z "${PARTITION:-}" ] || args+=(--partition="$PARTITION")
[ -z "${ACCOUNT:-}" ] || args+=(--account="$ACCOUNT")
# shellcheck disable=SC2206  # deliberately split
[ -z "${SBATCH_EXTRA:-}" ] || args+=(${SBATCH_EXTRA})

if [ "${NO_WAIT:-0}" = 1 ]; then
    exec sbatch --parsable "${args[@]}" "$here/validate.sbatch" "$@"
fi
# --wait: sbatch returns when the job ends, with its exit code (the job's --time bounds the wait).
exec sbatch --wait "${args[@]}" "$here/validate.sbatch" "$@"
