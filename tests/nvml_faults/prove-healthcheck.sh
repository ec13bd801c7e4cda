#!/usr/bin/env bash
# On a GPU machine, from the repository root (OUT set): healthcheck cold and warm, the full tier warm, and the
# verdict path under boundary faults (NVML patched beneath stackproof; a real second process holding 100 GiB).
# The tarball is rewritten after each run, so a call cut short still brings back what ran.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=$OUT/r; mkdir -p $O
t() { local name=$1; shift; local s=$(date +%s%N); "$@" > $O/$name.log 2>&1; local rc=$?; local e=$(date +%s%N);
      echo "$name: exit $rc, $(( (e - s) / 1000000 )) ms: $(tail -n 1 $O/$name.log)" | tee -a $O/summary.txt
      tar czf $OUT/gpu24.tgz -C $O .; }
HC="python3 -m stackproof healthcheck --scheduler none --node h200"
t hc-cold $HC --reports $O/hc-cold
t hc-warm1 $HC --reports $O/hc-warm1
t hc-warm2 $HC --reports $O/hc-warm2
t fast-warm python3 -m stackproof validate --tier fast --reports $O/fast
grep -E "Verdict|wall time" $O/fast-warm.log
t full-warm python3 -m stackproof validate --tier full --reports $O/full
grep -E "Verdict|wall time" $O/full-warm.log
F="env PYTHONPATH=$PWD/tests/nvml_faults:$PWD"
t hc-gpu-lost $F NVML_FAULT=gpu-lost $HC --reports $O/hc-gpu-lost
t hc-ecc-off $F NVML_FAULT=ecc-off $HC --reports $O/hc-ecc-off
python3 -c "import torch, time; x = torch.empty(100 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); open('$O/held', 'w').write('1'); time.sleep(60)" &
holder=$!
for _ in $(seq 60); do [ -f "$O/held" ] && break; sleep 0.5; done
t hc-leftover-100gib $HC --reports $O/hc-leftover
kill $holder; wait $holder 2>/dev/null
grep -h "stackproof act:" $O/hc-*.log
tar czf $OUT/gpu24.tgz -C $O .
