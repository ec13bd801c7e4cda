#!/usr/bin/env bash
# Refuse a job's image unless it holds a signed PASSED stackproof result for this node's class
# (`stackproof verify-image`, docs/attest.md). Opt-in: it checks nothing unless STACKPROOF_IMAGE_GATE=1.
#
# As a Slurm Prolog (slurm.conf: Prolog=/opt/stackproof/scripts/slurm/image-gate.sh, or called from the site's
# Prolog), it reads the job's image from SPANK_STACKPROOF_IMAGE (a Prolog sees only the SPANK_-prefixed variables
# of the job's environment: submit with `SPANK_STACKPROOF_IMAGE=REGISTRY/IMAGE@sha256:... sbatch ...`). A refused
# job is cancelled (scancel, with the reason in its comment) and the Prolog exits 0: an unproven image is the
# job's problem, never the node's, and a failing Prolog would drain the node.
#
# From a launcher (scripts/slurm/validate.sbatch runs it on every node of the job before its step), or by hand:
#   image-gate.sh [IMAGE]     # exit 0 proven (or the gate is off), 1 refused; the reason is on stdout
#
# The image may be in pyxis's form (REGISTRY#IMAGE:TAG). Settings come from STACKPROOF_IMAGE_GATE_CONF (default
# /etc/default/stackproof-image-gate, sourced when present), else the environment:
#   STACKPROOF_IMAGE_GATE=1       turn the gate on (default off)
#   STACKPROOF_ATTEST_PUB         the cosign public key the results must be signed with (default
#                                 /etc/stackproof/cosign.pub)
#   STACKPROOF_ATTEST_MAX_AGE     refuse results older than this (30d, 12h, ...; default any age)
#   STACKPROOF_NODE_CLASS         this node's class, when not read from NVML (`stackproof node-class` prints it)
#   STACKPROOF_PYTHON             interpreter with stackproof (default python3); cosign must be on PATH
#   STACKPROOF_REPO               a checkout to put on PYTHONPATH (default: none; stackproof is installed)
set -uo pipefail

conf="${STACKPROOF_IMAGE_GATE_CONF:-/etc/default/stackproof-image-gate}"
# shellcheck disable=SC1090  # the site's own settings file
[ ! -r "$conf" ] || . "$conf"
[ "${STACKPROOF_IMAGE_GATE:-0}" = 1 ] || exit 0
image="${1:-${SPANK_STACKPROOF_IMAGE:-}}"
[ -n "$image" ] || exit 0  # no container image named: nothing to hold to a proof
image="${image/\#//}"      # pyxis: REGISTRY#IMAGE -> REGISTRY/IMAGE
PYTHON="${STACKPROOF_PYTHON:-python3}"
[ -z "${STACKPROOF_REPO:-}" ] || export PYTHONPATH="$STACKPROOF_REPO${PYTHONPATH:+:$PYTHONPATH}"
export STACKPROOF_ATTEST_PUB="${STACKPROOF_ATTEST_PUB:-/etc/stackproof/cosign.pub}"

said="$("$PYTHON" -m stackproof verify-image "$image" 2>&1)"
rc=$?
echo "$said"
[ "$rc" != 0 ] || exit 0
if [ "${SLURM_SCRIPT_CONTEXT:-}" = prolog_slurmd ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    reason="stackproof image gate: $(printf '%s' "$said" | tail -n 1 | cut -c1-200)"
    scontrol update jobid="$SLURM_JOB_ID" comment="$reason" || true
    scancel "$SLURM_JOB_ID" || echo "stackproof image gate: could not cancel job $SLURM_JOB_ID" >&2
    exit 0
fi
exit 1
