"""What the fast tier's per-GPU measurements cost and how much their figures move with fewer iterations.

    python benchmarks/per_gpu_spread.py              # GPU 0, 5 repeats of each setting
    python benchmarks/per_gpu_spread.py --repeats 8 --device 1

For each measurement of stackproof/measure/gpu_proof.py (device copy, pinned host<->device copies, bf16 GEMM, the
SDC digest and the exact GEMM) and each iteration setting: the wall seconds of one call (allocation included) and
the figure's median, spread (max - min) / median, min and max over the repeats. A shorter setting is only worth
taking where its spread stays as small as the current one's. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from stackproof.measure import gpu_proof


def settings_to_try(device: torch.device):
    """(name, unit scale, unit, call returning the figure)."""
    def copy(warmup, iters):
        return lambda: gpu_proof.device_copy_bytes_per_s(device, warmup=warmup, iters=iters)[0]

    def pinned(to_device, warmup, iters):
        return lambda: gpu_proof.pinned_copy_bytes_per_s(device, to_device, warmup=warmup, iters=iters)[0]

    def gemm(warmup, iters):
        return lambda: gpu_proof.gemm_flops_per_s(device, warmup=warmup, iters=iters)[0]

    return [
        ("hbm copy 1 GiB, 5 warm-up + 50", 1e12, "TB/s", copy(5, 50)),
        ("hbm copy 1 GiB, 2 warm-up + 20", 1e12, "TB/s", copy(2, 20)),
        ("hbm copy 1 GiB, 2 warm-up + 10", 1e12, "TB/s", copy(2, 10)),
        ("h2d 512 MiB, 2 warm-up + 10", 1e9, "GB/s", pinned(True, 2, 10)),
        ("h2d 512 MiB, 1 warm-up + 4", 1e9, "GB/s", pinned(True, 1, 4)),
        ("d2h 512 MiB, 2 warm-up + 10", 1e9, "GB/s", pinned(False, 2, 10)),
        ("d2h 512 MiB, 1 warm-up + 4", 1e9, "GB/s", pinned(False, 1, 4)),
        ("gemm bf16 8192, 10 warm-up + 50", 1e12, "TFLOP/s", gemm(10, 50)),
        ("gemm bf16 8192, 5 warm-up + 20", 1e12, "TFLOP/s", gemm(5, 20)),
        ("gemm bf16 8192, 3 warm-up + 10", 1e12, "TFLOP/s", gemm(3, 10)),
        ("sdc digest chain (2048, 8 steps)", 1, "", lambda: gpu_proof.digest_chain(device)),
        ("exact gemm (2048 x 256)", 1, "", lambda: sum(gpu_proof.exact_gemm_mismatches(device).values())),
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", type=int, default=0)
    options = parser.parse_args(argv)
    device = torch.device("cuda", options.device)
    begin = time.perf_counter()
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    print(f"# {torch.cuda.get_device_name(device)}: CUDA context {time.perf_counter() - begin:.2f} s")
    print(f"# {'measurement':<36} {'call (s)':>9} {'median':>10} {'spread':>7} {'min':>10} {'max':>10}  unit")
    for name, scale, unit, call in settings_to_try(device):
        walls, figures = [], []
        for _ in range(options.repeats):
            begin = time.perf_counter()
            figure = call()
            torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - begin)
            figures.append(figure)
        if isinstance(figures[0], str):
            print(f"  {name:<36} {statistics.median(walls):>9.3f} {len(set(figures)):>10} distinct digest(s)")
            continue
        values = [f / scale for f in figures]
        mid = statistics.median(values)
        spread = (max(values) - min(values)) / mid if mid else 0.0
        print(f"  {name:<36} {statistics.median(walls):>9.3f} {mid:>10.3f} {spread:>7.2%} {min(values):>10.3f} "
              f"{max(values):>10.3f}  {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
