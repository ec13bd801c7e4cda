#!/usr/bin/env bash
# Slurm's HealthCheckProgram, or a Prolog: validate this node (`stackproof healthcheck`, tier fast) and, when a
# check failed on it, drain it: scontrol update nodename=<node> state=drain reason="stackproof: <check> <gpu>".
# Bad input, no GPU visible, the tool's own timeout or an interruption are logged, never acted on (docs/act.md).
#
# slurm.conf (docs/act.md):
#   HealthCheckProgram=/opt/stackproof/scripts/slurm/healthcheck.sh
#   HealthCheckInterval=3600
#   HealthCheckNodeState=IDLE,CYCLE     # only on idle nodes: the checks measure the GPUs
#   Prolog=/opt/stackproof/scripts/slurm/healthcheck.sh    # or: before every job
#
# slurmd runs it as root with no arguments; any arguments (by hand, or through srun in the tests) go to
# `stackproof healthcheck` after the defaults below, so they win.
# Exit: 0, except in a Prolog (SLURM_JOB_ID set) on a node it has just drained: 1, so that Slurm does not start
# the job there (it requeues it; SchedulerParameters=nohold_on_prolog_fail keeps it from being held). A
# problem of the tool itself exits 0: a Prolog's non-zero exit would drain the node for the tool's fault.
#
# Env: STACKPROOF_NODE_NAME      the node's Slurm name (default SLURMD_NODENAME, which slurmd sets for a
#                                Prolog and srun for a task, else `hostname -s`)
#      STACKPROOF_PYTHON         interpreter with torch + stackproof (default python3)
#      STACKPROOF_REPO           a checkout to put on PYTHONPATH (default: none; stackproof is installed)
#      STACKPROOF_HEALTHCHECK_REPORTS  reports root (default /var/lib/stackproof/healthcheck); the run's
#                                report, junit.xml, stackproof.prom and healthcheck.log land in <root>/<node>
#      STACKPROOF_HEALTHCHECK_RUN_TIMEOUT_S  validate --run-timeout (default 50: slurmd stops a
#                                HealthCheckProgram after 60 s); a run stopped by it is exit 4, not acted on
#      STACKPROOF_HEALTHCHECK_ARGS more flags for `stackproof healthcheck` (split on spaces), e.g.
#                                "--expect-gpus 8 --image current"
set -uo pipefail

node="${STACKPROOF_NODE_NAME:-${SLURMD_NODENAME:-$(hostname -s)}}"
PYTHON="${STACKPROOF_PYTHON:-python3}"
reports="${STACKPROOF_HEALTHCHECK_REPORTS:-/var/lib/stackproof/healthcheck}/$node"
[ -z "${STACKPROOF_REPO:-}" ] || export PYTHONPATH="$STACKPROOF_REPO${PYTHONPATH:+:$PYTHONPATH}"
# A Prolog inherits the job's environment: its ranks' variables must not make this run a rank of the job.
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT SLURM_PROCID SLURM_NTASKS
mkdir -p "$reports" || { echo "stackproof healthcheck: cannot create $reports; not acted on" >&2; exit 0; }

args=(--scheduler slurm --node "$node" --tier fast --reports "$reports"
      --run-timeout "${STACKPROOF_HEALTHCHECK_RUN_TIMEOUT_S:-50}" --timeout 20)
# shellcheck disable=SC2206  # deliberately split: several flags in one variable
[ -z "${STACKPROOF_HEALTHCHECK_ARGS:-}" ] || args+=(${STACKPROOF_HEALTHCHECK_ARGS})

{ date -u +"# %Y-%m-%dT%H:%M:%SZ stackproof healthcheck on $node"; } >>"$reports/healthcheck.log"
"$PYTHON" -m stackproof healthcheck "${args[@]}" "$@" 2>&1 | tee -a "$reports/healthcheck.log"
rc="${PIPESTATUS[0]}"
echo "# exit $rc" >>"$reports/healthcheck.log"
# 1: a check failed and the node was drained (a failed drain exits 2: stackproof act said why).
if [ "$rc" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then exit 1; fi
exit 0
