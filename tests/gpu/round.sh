#!/usr/bin/env bash
# On one GPU host, from the repository root, in one call: this round's proofs on the GPU, each kept under OUT.
#   tests/gpu/round.sh OUT COMMIT [PART...]     # PART: 1-8, default all (a call of the device tool lasts 10 min)
# 1. the acceptance run (scripts/gpu-acceptance.sh) of the tree, headed by COMMIT;
# 2. where a healthcheck's time goes, cold, warm and with the agent (benchmarks/startup.py: the exit's costs apart
#    too), and the idle warm agent under NVML; as this host's Python has it, then with every module's bytecode
#    compiled (into a PYTHONPYCACHEPREFIX), as a pip install leaves torch;
# 3. a rank hung in a CUDA kernel, patched in from outside (tests/fault_plugins/torch_faults.py), under
#    scripts/slurm/healthcheck.sh's defaults as a dry run: named and taken out within the deadline;
# 4. two healthchecks started together: one judges, the other says one is running;
# 5. counter faults (NVML patched beneath stackproof) still red in the healthcheck;
# 6. the transformer-era checks under boundary faults (tests/fault_plugins/prove_training.sh), bench parallel;
# 7. host<->device and device copies corrupted (torch patched beneath the suite): the fast tier names the bytes;
# 8. another process's GEMMs on the GPU throughout: the figures below their bars, named as the GPU's.
set -u
OUT=${1:?usage: round.sh OUT COMMIT}
COMMIT=${2:-unknown}
shift 2
PARTS=" ${*:-1 2 3 4 5 6 7 8} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
T=$(mktemp -d); mkdir "$T/plugin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log=$OUT/round.txt
say() { echo "$*" | tee -a "$log"; }
failed() {  # FOLDER: each check of its report.json that did not pass, with its findings
    python3 - "$1" >>"$log" 2>&1 <<'PY'
import json, sys
for check in json.load(open(f"{sys.argv[1]}/report.json"))["checks"]:
    if check["outcome"] != "passed":
        print(f"  {check['name']} {check['outcome']}")
        for f in check["findings"]:
            print(f"    [{f['category']}/{f['severity']}] {f['check']}: expected {f['expected'][:90]}, found {f['found'][:120]}")
PY
}
timed() {  # NAME CMD...: run, time, keep the log, say the exit and the last verdict lines
    local name=$1; shift
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    say "$name: exit $rc, $((SECONDS - start)) s; $(grep -hE 'healthcheck:|stackproof act:|# Verdict' "$OUT/$name.log" | tail -n 2 | tr '\n' ' ' | cut -c1-400)"
}

if part 1; then
say "## 1. acceptance"
ACCEPT_COMMIT=$COMMIT scripts/gpu-acceptance.sh "$OUT/acc" >/dev/null 2>&1
say "acceptance exit $?"; cat "$OUT/acc/summary.txt" >>"$log"
fi
if part 2; then
say "## 2. start-up, cold, warm and with the warm agent, the ranks' exit and its costs apart"
timed startup python3 benchmarks/startup.py --runs 3 --drop-caches --exit-costs --out "$OUT/startup-healthcheck.txt" \
    -- healthcheck --scheduler none
cat "$OUT/startup-healthcheck.txt" >>"$log" 2>/dev/null
say "## 2b. the same with every module's bytecode compiled, as pip's install leaves it (this host's torch has none)"
site=$(python3 -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("torch").origin).parents[1])')
(
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=$T/pycache  # read-only installs too; Python looks only here for bytecode
    python3 -m compileall -q -j 0 "$site" "$PWD/stackproof" >/dev/null 2>&1
    timed startup-compiled python3 benchmarks/startup.py --runs 3 --drop-caches --exit-costs \
        --out "$OUT/startup-compiled.txt" -- healthcheck --scheduler none
)
cat "$OUT/startup-compiled.txt" >>"$log" 2>/dev/null
fi
if part 3; then
say "## 3. a rank hung in a CUDA kernel under healthcheck.sh's defaults (dry run)"
printf 'import torch_faults\ntorch_faults.install(["kernel-hangs"], rank=0)\n' >"$T/plugin/injected_faults.py"
timed hang env STACKPROOF_HEALTHCHECK_CONF=/nonexistent STACKPROOF_HEALTHCHECK_REPORTS="$T/r" STACKPROOF_PYTHON=python3 \
    STACKPROOF_REPO="$PWD" PYTHONPATH="$T/plugin:$PWD/tests/fault_plugins" PYTEST_PLUGINS=injected_faults \
    SLURMD_NODENAME=h200 bash scripts/slurm/healthcheck.sh --scheduler none
grep -h "GPU hang\|stackproof act:\|healthcheck:" "$T/r/h200/healthcheck.log" >>"$log" 2>/dev/null
cp -r "$T/r" "$OUT/hang-reports" 2>/dev/null
fi
if part 4; then
say "## 4. two healthchecks at once"
for i in 1 2; do python3 -m stackproof healthcheck --scheduler none --node h200 --reports "$T/two" >"$OUT/two$i.log" 2>&1 & done
wait
grep -h "healthcheck:" "$OUT"/two?.log >>"$log"
fi
if part 5; then
say "## 5. counter faults in the healthcheck (NVML patched beneath stackproof)"
for fault in pcie-replays sbe-312k power-60; do
    timed "hc-$fault" env NVML_FAULT=$fault PYTHONPATH="$PWD/tests/nvml_faults:$PWD" \
        python3 -m stackproof healthcheck --scheduler none --node h200 --reports "$OUT/hc-$fault"
done
fi
if part 6; then
say "## 6. the transformer-era checks under boundary faults, and bench parallel"
SKIP_TIERS=1 bash tests/fault_plugins/prove_training.sh "$OUT/kernels" >>"$log" 2>&1
say "prove_training exit $?"
fi
if part 7; then
say "## 7. copies corrupted (torch patched beneath the suite, tests/fault_plugins/torch_faults.py): the fast tier red"
printf 'import torch_faults\ntorch_faults.install(["h2d-copy-corrupts", "d2h-copy-corrupts", "d2d-copy-corrupts"], rank=0)\n' \
    >"$T/plugin/injected_copies.py"
timed copies env PYTHONPATH="$T/plugin:$PWD/tests/fault_plugins:$PWD" PYTEST_PLUGINS=injected_copies \
    python3 -m stackproof validate --tier fast --reports "$OUT/copies"
failed "$OUT/copies"
fi
if part 8; then
say "## 8. another process's GEMMs on the GPU throughout: the fast tier's figures below their bars, red"
python3 -c 'import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 35
while time.time() < end:
    a @ a
torch.cuda.synchronize()' >"$OUT/competing.log" 2>&1 &
sleep 8  # its import and first GEMMs
timed competing-gemms python3 -m stackproof validate --tier fast --reports "$OUT/competing"
wait
failed "$OUT/competing"
fi
say "## done"
