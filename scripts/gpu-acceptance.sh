#!/usr/bin/env bash
# The GPU acceptance run: the default commands on a healthy GPU host must be green. Run it on the final tree of
# every change that touches the suite, on a GPU host, from the repository root, and record its summary (headed by
# the commit) in docs/gpu-acceptance.md.
#
#   scripts/gpu-acceptance.sh [OUT]          # OUT: where the logs, reports and summary go (default ./acceptance)
#
# Runs, each timed: healthcheck x3 (the Prolog's command: cold, then warm), the fast, full and burn tiers of
# validate, and two emulated nodes over NCCL's socket transport (scripts/emulate/nodes.sh, distinct NCCL_HOSTID);
# the image path too when ACCEPT_IMAGE names an image docker can run here. Prints a one-screen summary and exits
# non-zero when any healthy run is not green (healthcheck exit 0, validate exit 0).
# Env: ACCEPT_COMMIT (the commit the tree is, where no .git travels with it), ACCEPT_BURN_S (default 30),
# ACCEPT_IMAGE, ACCEPT_DOCKER_ARGS (how the engine hands over the GPUs, default --gpus all), ACCEPT_IMAGE_CMD,
# STACKPROOF_PYTHON (default python3).
set -u
out=$(mkdir -p "${1:-acceptance}" && cd "${1:-acceptance}" && pwd)
py=${STACKPROOF_PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary=$out/summary.txt
commit=${ACCEPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
gpu=$("$py" -c 'import pynvml as n; n.nvmlInit(); c = n.nvmlDeviceGetCount(); print(f"{c} x {n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(0))}, driver {n.nvmlSystemGetDriverVersion()}" if c else "no GPU")' 2>/dev/null || echo "NVML unreadable")
versions=$("$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version())' 2>/dev/null || echo "torch unreadable")
{
    echo "# stackproof GPU acceptance"
    echo "commit: $commit"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $gpu; $versions"
    printf '%-22s %5s %8s  %s\n' run exit seconds "verdict (last line of the run)"
} >"$summary"
failed=0

# run NAME EXPECTED CMD...: time it, keep its log, say its last verdict line.
run() {
    local name=$1 want=$2; shift 2
    local start end rc said
    start=$(date +%s.%N)
    "$@" >"$out/$name.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    said=$(grep -E "^# Verdict|^stackproof (healthcheck|act)" "$out/$name.log" | tail -n 1)
    [ -n "$said" ] || said=$(tail -n 1 "$out/$name.log")
    printf '%-22s %5s %8.1f  %s\n' "$name" "$rc" "$(awk "BEGIN {print $end - $start}")" "${said:0:150}" >>"$summary"
    if [ "$rc" != "$want" ]; then
        failed=1
        echo "  ^ expected exit $want" >>"$summary"
    fi
}

node=acceptance-$(hostname -s)
for i in 1 2 3; do
    run "healthcheck-$i" 0 "$py" -m stackproof healthcheck --scheduler none --node "$node" --reports "$out/hc-$i"
done
run validate-fast 0 "$py" -m stackproof validate --tier fast --reports "$out/fast"
run validate-full 0 "$py" -m stackproof validate --tier full --reports "$out/full"
run validate-burn 0 "$py" -m stackproof validate --tier burn --burn-seconds "${ACCEPT_BURN_S:-30}" \
    --reports "$out/burn"
# The multi-node path over sockets (1.7-1.9 GB/s on loopback): a sweep to 256 MiB proves it; 4 GiB would time
# the loopback for two minutes.
run emulated-2-nodes 0 env STACKPROOF_PYTHON="$py" scripts/emulate/nodes.sh 2 --reports "$out/emu" --sweep-max 256M
if [ -n "${ACCEPT_IMAGE:-}" ] && command -v docker >/dev/null; then
    # A validation image runs its own entrypoint; any other image with python3 + torch (ACCEPT_IMAGE_CMD, e.g.
    # "python3 -m stackproof validate --reports /reports") runs this tree's suite, mounted at /src.
    read -r -a gpu_args <<<"${ACCEPT_DOCKER_ARGS:---gpus all}"
    read -r -a image_cmd <<<"${ACCEPT_IMAGE_CMD:-}"
    mount=()
    [ ${#image_cmd[@]} -gt 0 ] && mount=(-v "$PWD:/src:ro" -w /src -e PYTHONPATH=/src)
    mkdir -p "$out/image"
    run image 0 docker run --rm "${gpu_args[@]}" --ipc=host --network host -e NCCL_NVLS_ENABLE=0 \
        -e TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -e NVSHMEM_DISABLE_NVLS=1 -v "$out/image:/reports" "${mount[@]}" \
        "$ACCEPT_IMAGE" "${image_cmd[@]}"
else
    echo "image: not run (no ACCEPT_IMAGE, or no docker on this host)" >>"$summary"
fi
# Where the time of a healthcheck goes (the record's phases), from the last warm one.
"$py" - "$out/hc-3" >>"$summary" 2>/dev/null <<'EOF'
import json, sys
from stackproof.report.record import report_file
from pathlib import Path
data = json.loads(report_file(Path(sys.argv[1])).read_text())
print(f"healthcheck-3: {len(data['checks'])} checks, wall {data['wall_time_s']} s; checks "
      f"{sum(c['duration_s'] for c in data['checks']):.2f} s")
EOF
echo "result: $([ $failed = 0 ] && echo "GREEN: every healthy run passed" || echo "RED: a healthy run was not green")" \
    >>"$summary"
cat "$summary"
exit $failed
