#!/usr/bin/env bash
# On a GPU machine, from the repository root: the fast tier healthy, then each boundary fault (NVML patched
# beneath stackproof by tests/nvml_faults/sitecustomize.py; a real second process holding 100 GiB of the GPU).
# Writes OUT/<run>/report.json and OUT/<run>.log; prints one line per run.
set -u
OUT=${1:?usage: prove.sh OUT_DIR}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # NAME [ENV...]
  local name=$1; shift
  local start=$(date +%s%N)
  env "$@" PYTHONPATH="$PWD/tests/nvml_faults:$PWD" timeout 90 python3 -m stackproof validate --tier fast \
    --reports "$OUT/$name" > "$OUT/$name.log" 2>&1
  local rc=$? end=$(date +%s%N)
  local failed=$(grep -E '^  [a-z_0-9]+::[a-z_0-9]+ +FAIL' "$OUT/$name.log" | awk '{print $1}' | tr '\n' ' ')
  echo "$name: exit $rc, $(( (end - start) / 1000000 )) ms; failed: ${failed:-none}; $(grep -m1 -o 'wall time [0-9.]* s' "$OUT/$name.log")"
}
run healthy
python3 -c "import torch, time; x = torch.empty(100 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); open('$OUT/held', 'w').write('1'); time.sleep(120)" &
holder=$!
for _ in $(seq 60); do [ -f "$OUT/held" ] && break; sleep 0.5; done
run foreign-100gib
kill "$holder"; wait "$holder" 2>/dev/null
run ecc-off NVML_FAULT=ecc-off
run clocks-0x60 NVML_FAULT=clocks-0x60
run pcie-gen3x8 NVML_FAULT=pcie-gen3x8
run unknown-error NVML_FAULT=unknown-error
