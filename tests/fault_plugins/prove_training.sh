#!/usr/bin/env bash
# On a GPU machine, from the repository root: the training checks (GEMMs at every K class, attention backends,
# optimizers, the transformer step) green on a healthy run, each red under its fault from outside the suite
# (tests/fault_plugins/torch_faults.py), the fast and full tiers' wall time, and `stackproof bench parallel`.
# Writes OUT/<run>/report.json, OUT/<run>.log, OUT/parallel.{txt,json,svg}; prints one line per run (exit, time,
# the checks that failed). Sub-group collectives need 2+ GPUs (NPROC=2 ...); CPU ranks prove them in CI.
set -u
OUT=${1:?usage: prove_training.sh OUT_DIR}
NPROC=${NPROC:-1}
PYTHON=${STACKPROOF_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SELECT="gemms_at_every or attention or optimizer_step or float64_reference or sub_groups"
mkdir -p "$OUT/plugin"
run() {  # NAME FAULTS(comma-separated)|- [validate flags...]
  local name=$1 faults=$2; shift 2
  local path="$PWD" plugins=""
  if [ "$faults" != - ]; then
    printf "import torch_faults\ntorch_faults.install(%s, rank=0)\n" \
      "$("$PYTHON" -c "import sys; print(sys.argv[1].split(','))" "$faults")" > "$OUT/plugin/injected_faults.py"
    path="$OUT/plugin:$PWD/tests/fault_plugins:$PWD" plugins=injected_faults
  fi
  local start end rc failed
  start=$(date +%s%N)
  PYTHONPATH="$path" PYTEST_PLUGINS="$plugins" timeout 900 "$PYTHON" -m stackproof validate --nproc "$NPROC" \
    --reports "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  failed=$(grep -E '^  [a-z_0-9]+::[^ ]+ +FAIL' "$OUT/$name.log" | awk '{print $1}' | tr '\n' ' ')
  echo "$name: exit $rc, $(( (end - start) / 1000000 )) ms; failed: ${failed:-none}; $(grep -m1 -o 'wall time [0-9.]* s' "$OUT/$name.log")"
  return $rc
}
run healthy - -k "$SELECT" || { tail -40 "$OUT/healthy.log"; exit 1; }
grep -E 'gemms_at_every|attention::|optimizer_step|float64_reference|sub_groups' "$OUT/healthy.log"
if [ -z "${SKIP_TIERS:-}" ]; then  # the acceptance run times the tiers too (tests/gpu/round.sh sets it)
    run fast-tier - --tier fast
    run full-tier -
fi
run gemm-fault half-gemm-wrong-at-large-k -k "gemms_at_every"  # fp16, bf16, fp8 at K 2080 and 8224 red
run attention-fault attention-head-wrong -k "attention or float64_reference"  # every backend, head 1; the step
run adamw-fault adamw-decays-twice -k "optimizer_step or float64_reference"  # AdamW's three forms; the step
run no-sync-fault no-sync-loses-gradients -k "float64_reference"  # DDP's steps red, FSDP2's green
[ "$NPROC" -ge 2 ] && run sub-group-fault sub-group-corrupts -k "sub_groups"
"$PYTHON" -m stackproof bench parallel -o "$OUT/parallel.json" --plot "$OUT/parallel.svg" > "$OUT/parallel.txt" 2>&1
echo "bench parallel: exit $?"; cat "$OUT/parallel.txt"
exit 0
