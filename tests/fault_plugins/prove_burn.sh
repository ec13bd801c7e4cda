#!/usr/bin/env bash
# On a GPU machine, from the repository root: the burn-in tier healthy (HEALTHY_RUNS runs of HEALTHY_S seconds),
# and each fault that appears only after a stretch of load (tests/fault_plugins/burn_faults.py, active AFTER_S
# seconds into a FAULT_S soak, on rank 0). A first short healthy soak must pass before the rest run (a broken
# build costs seconds, not minutes). Writes OUT/<run>/report.json, OUT/<run>.log and OUT/summary.txt (the series,
# benchmarks/burn_series.py); prints one line per run.
set -u
OUT=${1:?usage: prove_burn.sh OUT_DIR [HEALTHY_S] [HEALTHY_RUNS] [FAULT_S] [AFTER_S]}
HEALTHY_S=${2:-60} HEALTHY_RUNS=${3:-3} FAULT_S=${4:-12} AFTER_S=${5:-6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/plugin"
run() {  # NAME FAULT|- SECONDS [validate flags...]
  local name=$1 fault=$2 seconds=$3; shift 3
  local path="$PWD" plugins=""
  if [ "$fault" != - ]; then
    printf "from burn_faults import install, pytest_runtest_setup  # noqa: F401\ninstall(['%s'], rank=0, after_s=%s)\n" \
      "$fault" "$AFTER_S" > "$OUT/plugin/injected_burn.py"
    path="$OUT/plugin:$PWD/tests/fault_plugins:$PWD" plugins=injected_burn
  fi
  local start end rc failed
  start=$(date +%s%N)
  PYTHONPATH="$path" PYTEST_PLUGINS="$plugins" timeout $(( seconds + 150 )) python3 -m stackproof validate \
    --tier burn --burn-seconds "$seconds" --reports "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  failed=$(grep -E '^  [a-z_0-9]+::[a-z_0-9]+ +FAIL' "$OUT/$name.log" | awk '{print $1}' | tr '\n' ' ')
  echo "$name: exit $rc, $(( (end - start) / 1000000 )) ms; failed: ${failed:-none}; $(grep -m1 -o 'wall time [0-9.]* s' "$OUT/$name.log")"
  return $rc
}
run quick - 8 -k burn || { tail -40 "$OUT/quick.log"; exit 1; }
run gemm-wrong-after gemm-wrong-after "$FAULT_S" -k burn
run sag-after sag-after "$FAULT_S" -k burn
run thermal-after thermal-after "$FAULT_S" -k burn
for i in $(seq "$HEALTHY_RUNS"); do run "healthy-$i" - "$HEALTHY_S"; done
python3 benchmarks/burn_series.py --step 5 "$OUT"/quick/ "$OUT"/*-after/ "$OUT"/healthy-*/ > "$OUT/summary.txt" 2>&1
