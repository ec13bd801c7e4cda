#!/usr/bin/env bash
# Slurm's HealthCheckProgram, or a Prolog: validate this node (`stackproof healthcheck`, tier fast) and act as
# the policy table says (docs/act.md): a hardware failure drains it, scontrol update nodename=<node>
# state=drain reason="stackproof: <check> <gpu>", unless the circuit breaker (--max-drained, default 10% of the
# node's partitions) holds it; an image, pins or settings failure, bad input, the tool's own timeout or an
# interruption are logged (stackproof ALERT lines), never acted on. On a node stackproof drained it runs the
# node's re-proof instead (--reproof-tiers, full then burn, detached: it outlives slurmd's 60 s) and resumes the
# node when it passes; a node drained for another reason is left alone (docs/act.md, "Back in service only by
# proof"). HealthCheckNodeState must include drained idle nodes: IDLE or ANY, not NONDRAINED_IDLE.
#
# slurm.conf (docs/act.md):
#   HealthCheckProgram=/opt/stackproof/scripts/slurm/healthcheck.sh
#   HealthCheckInterval=3600
#   HealthCheckNodeState=IDLE,CYCLE     # only on idle nodes: the checks measure the GPUs
#   Prolog=/opt/stackproof/scripts/slurm/healthcheck.sh    # or: before every job
#
# The scheduler's contract: `stackproof healthcheck` exits TAKEN_OUT (86, stackproof/errors.py's Healthcheck: a
# code no crash gives) only when this node is taken out of service (drained now, or it would have been with
# --scheduler none); this script turns that, and only that, into 1 for slurmd, except for a dry run (--scheduler
# none given here: it drained nothing, and a Prolog's 1 would make Slurm drain the node itself). Everything else
# exits 0 with the reason in the log: a pass, an alert, a drain the circuit breaker withheld, bad input, the
# tool's own failure (no python, stackproof not importable, a missing dependency, a crash: a BROKEN line, and
# stackproof_healthcheck_broken 1 in <reports>/stackproof-healthcheck.prom for node_exporter). In a Prolog, 1
# keeps the job off this node (a batch job is requeued elsewhere; SchedulerParameters=nohold_on_prolog_fail
# keeps it from being held).
#
# slurmd runs it as root, with no arguments and almost no environment (SLURMD_NODENAME; a Prolog also the
# job's SLURM_JOB_ID ...): the settings below come from the file STACKPROOF_HEALTHCHECK_CONF (default
# /etc/default/stackproof-healthcheck, sourced when present), else the environment. Any arguments (by hand, or
# through srun) go to `stackproof healthcheck` after the defaults below, so they win.
#
# Settings: STACKPROOF_NODE_NAME      the node's Slurm name (default SLURMD_NODENAME, else `hostname -s`)
#      STACKPROOF_PYTHON         interpreter with torch + stackproof (default python3)
#      STACKPROOF_REPO           a checkout to put on PYTHONPATH (default: none; stackproof is installed)
#      STACKPROOF_HEALTHCHECK_REPORTS  reports root (default /var/lib/stackproof/healthcheck); healthcheck.log
#                                lands in <root>/<node>, each run's report, junit.xml and stackproof.prom in
#                                <root>/<node>/runs/<started>-<pid> (links latest, last-acted; the newest 20
#                                kept: --keep-runs); node_exporter's textfile collector reads <root>/<node>/latest
#      STACKPROOF_HEALTHCHECK_RUN_TIMEOUT_S  validate --run-timeout (default: none; healthcheck's one
#                                --deadline, 57 s under slurmd's 60 s, cuts it to what the survey, stopping the
#                                ranks and acting leave: act/deadline.py); a run stopped by it is exit 4, not acted on
#      STACKPROOF_HEALTHCHECK_ARGS more flags for `stackproof healthcheck` (split on spaces), e.g.
#                                "--expect-gpus 8 --image current --max-drained 2"
set -uo pipefail

conf="${STACKPROOF_HEALTHCHECK_CONF:-/etc/default/stackproof-healthcheck}"
# shellcheck disable=SC1090  # the site's own settings file
[ ! -r "$conf" ] || . "$conf"
node="${STACKPROOF_NODE_NAME:-${SLURMD_NODENAME:-$(hostname -s)}}"
PYTHON="${STACKPROOF_PYTHON:-python3}"
reports="${STACKPROOF_HEALTHCHECK_REPORTS:-/var/lib/stackproof/healthcheck}/$node"
[ -z "${STACKPROOF_REPO:-}" ] || export PYTHONPATH="$STACKPROOF_REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$reports" || { echo "stackproof healthcheck: cannot create $reports; not acted on; exit 0" >&2; exit 0; }

args=(--scheduler slurm --node "$node" --tier fast --reports "$reports" --timeout 20
      ${STACKPROOF_HEALTHCHECK_RUN_TIMEOUT_S:+--run-timeout "$STACKPROOF_HEALTHCHECK_RUN_TIMEOUT_S"})
# shellcheck disable=SC2206  # deliberately split: several flags in one variable
[ -z "${STACKPROOF_HEALTHCHECK_ARGS:-}" ] || args+=(${STACKPROOF_HEALTHCHECK_ARGS})

{ date -u +"# %Y-%m-%dT%H:%M:%SZ stackproof healthcheck on $node${SLURM_JOB_ID:+ (Prolog of job $SLURM_JOB_ID)}"; } \
    >>"$reports/healthcheck.log" 2>/dev/null
# stackproof healthcheck forgets a job's rank variables itself (it is this node's launcher, not a rank).
"$PYTHON" -m stackproof healthcheck "${args[@]}" "$@" 2>&1 | tee -a "$reports/healthcheck.log"
rc="${PIPESTATUS[0]}"
TAKEN_OUT=86  # stackproof/errors.py Healthcheck.TAKEN_OUT (tests/test_act_contract.py holds the two equal)
# The scheduler this run was given (the last --scheduler wins, as in argparse): a dry run (none) drained nothing,
# and its "would be taken out" must not become slurmd's failure: in a Prolog that drains the node ("Prolog error").
scheduler=""
prev=""
for arg in "${args[@]}" "$@"; do
    case "$arg" in --scheduler=*) scheduler="${arg#--scheduler=}" ;; esac
    [ "$prev" != "--scheduler" ] || scheduler="$arg"
    prev="$arg"
done
if [ "$rc" = "$TAKEN_OUT" ] && [ "$scheduler" = none ]; then
    out=0
    echo "# stackproof healthcheck: a dry run (--scheduler none) would have taken this node out of service;" \
         "exit 0, so that slurmd does not take it out itself (a Prolog's failure drains)" |
        tee -a "$reports/healthcheck.log"
elif [ "$rc" = "$TAKEN_OUT" ]; then
    out=1
else
    out=0
    if [ "$rc" != 0 ]; then
        # stackproof's own guard (python -m stackproof healthcheck) turns every failure it can see into 0: this
        # is one it could not see (no python, stackproof not importable, a signal). Loud, counted, never a drain.
        echo "stackproof healthcheck: BROKEN: $PYTHON -m stackproof healthcheck exited $rc before judging this" \
             "node; it stays in service; fix: make '$PYTHON -m stackproof --version' work (STACKPROOF_PYTHON," \
             "STACKPROOF_REPO)" | tee -a "$reports/healthcheck.log" >&2
        metric=stackproof_healthcheck_broken  # act/contract.py's BROKEN_METRIC, in its BROKEN_FILE, beside
        textfiles="$reports"                  # the newest run's stackproof.prom (run/folders.py's latest)
        [ ! -L "$reports/latest" ] || textfiles="$(readlink -f "$reports/latest")"
        printf '# HELP %s %s\n# TYPE %s gauge\n%s{reason="exit %s"} 1\n' "$metric" \
            "1 when the last stackproof healthcheck on this node could not run: the node was not judged" \
            "$metric" "$metric" "$rc" >"$textfiles/.stackproof-healthcheck.prom.$$" &&
            mv -f "$textfiles/.stackproof-healthcheck.prom.$$" "$textfiles/stackproof-healthcheck.prom"
    fi
fi
echo "# exit $out (stackproof healthcheck exited $rc)" >>"$reports/healthcheck.log" 2>/dev/null
exit "$out"
