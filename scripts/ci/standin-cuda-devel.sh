#!/usr/bin/env bash
# Registry-less CI only: tag a STAND-IN under the FROM name of each devel image of the matrix (e.g.
# nvidia/cuda:13.0.2-devel-ubuntu24.04), so the devel flavor's build steps (apt pin, hold, verify, uid 1000)
# can be tested. It has no CUDA: never push or run on GPUs what is built on it (label io.stackproof.standin).
# Skips a name that already exists (a real image stays untouched). Needs ubuntu:24.04 (base-images.sh).
set -euo pipefail

cd "$(dirname "$0")/../.."
log() { printf 'standin-cuda-devel: %s\n' "$*" >&2; }

PY="${PYTHON:-python3}"
"$PY" -c 'from stackproof.images.matrix import load_matrix
for i in load_matrix().images:
    if i.flavor == "devel":
        print(i.base, i.cuda, i.cuda_major, i.nccl, i.cudnn)' |
while read -r base cuda cuda_major nccl cudnn; do
    if docker image inspect "$base" >/dev/null 2>&1; then
        log "$base: already present, skipped"
        continue
    fi
    ubuntu="ubuntu:${base##*-ubuntu}"
    log "$base: building a stand-in on $ubuntu (NCCL $nccl, cuDNN $cudnn for CUDA $cuda)"
    docker buildx build --quiet --load --tag "$base" \
        --build-arg UBUNTU="$ubuntu" --build-arg CUDA="$cuda" --build-arg CUDA_MAJOR="$cuda_major" \
        --build-arg NCCL="$nccl" --build-arg CUDNN="$cudnn" \
        scripts/ci/standin-cuda-devel >/dev/null
    log "$base: stand-in tagged (label io.stackproof.standin=true)"
done
