#!/usr/bin/env bash
# On one GPU, from the repository root: the data checks' costs, the fast tier and healthcheck warm and healthy,
# the full tier once, then each boundary fault patched in from outside (tests/fault_plugins/torch_faults.py):
# corrupted H2D, D2H and D2D copies, and torch.compile handing back eager. Writes OUT/<run>/report.json, logs,
# and OUT/summary.txt.
set -u
OUT=${1:?usage: prove_data_checks.sh OUT_DIR}
mkdir -p "$OUT"
PLUG=$(mktemp -d)
summary() {  # NAME: the run's exit, wall time and each check's duration and failed findings
  python3 - "$OUT/$1" "$1" "$2" >> "$OUT/summary.txt" <<'PY'
import json, sys
folder, name, rc = sys.argv[1:]
try:
    report = json.load(open(f"{folder}/report.json"))
except OSError:
    print(f"{name}: exit {rc}, no report"); sys.exit()
print(f"{name}: exit {rc}, checks {report.get('wall_time_s', report.get('duration_s', '?'))} s")
for check in report["checks"]:
    line = f"  {check['name']:60} {check['outcome']:8} {check['duration_s'] or 0:7.3f} s"
    for finding in check["findings"]:
        line += f"\n      [{finding['category']}/{finding['severity']}] {finding['check']}: {finding['found'][:160]}"
    print(line)
PY
}
run() {  # NAME FAULTS(comma list or -) ARGS...
  local name=$1 faults=$2; shift 2
  local env=()
  if [ "$faults" != "-" ]; then
    echo "import torch_faults; torch_faults.install('$faults'.split(','), rank=0)" > "$PLUG/injected_$name.py"
    env=(PYTHONPATH="$PLUG:$PWD/tests/fault_plugins:$PWD" PYTEST_PLUGINS="injected_$name")
  fi
  local start=$(date +%s%N)
  env ${env[@]+"${env[@]}"} timeout 300 python3 -m stackproof "$@" --reports "$OUT/$name" > "$OUT/$name.log" 2>&1
  local rc=$? end=$(date +%s%N)
  echo "$name: $(( (end - start) / 1000000 )) ms wall" >> "$OUT/summary.txt"
  summary "$name" "$rc"
}
python3 tests/fixtures/nvml/record.py "$OUT/h200.json" > "$OUT/record.log" 2>&1
python3 benchmarks/data_checks.py > "$OUT/costs.txt" 2>&1
run fast-cold - validate --tier fast
run fast-warm - validate --tier fast
run healthcheck-warm - healthcheck --scheduler none
run full-mine - validate --tier full -k 'libraries or compile or convolutions or gpus or per_gpu'
run copies-corrupt h2d-copy-corrupts,d2h-copy-corrupts,d2d-copy-corrupts validate --tier fast
run compile-eager compile-returns-eager validate -k compile
for fault in pcie-replays sbe-312k power-60; do  # NVML patched beneath stackproof (tests/nvml_faults)
  start=$(date +%s%N)
  NVML_FAULT=$fault PYTHONPATH="$PWD/tests/nvml_faults:$PWD" timeout 120 python3 -m stackproof validate --tier fast \
    --reports "$OUT/nvml-$fault" > "$OUT/nvml-$fault.log" 2>&1
  rc=$?
  echo "nvml-$fault: $(( ($(date +%s%N) - start) / 1000000 )) ms wall" >> "$OUT/summary.txt"
  summary "nvml-$fault" "$rc"
done
