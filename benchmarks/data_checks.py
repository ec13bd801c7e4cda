"""What the data checks cost on this machine's first GPU: the memory test over most free memory, the HBM copy
and the host <-> device copies with and without their compare. Prints one line per figure (seconds, wall clock,
after a warm-up call of each)."""

from __future__ import annotations

import time

import torch

from stackproof.measure import gpu_proof, memtest, patterns


def wall(step) -> tuple[float, object]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = step()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


def pattern_costs(buffer: torch.Tensor) -> None:
    for _ in range(2):
        made, _ = wall(lambda: patterns.fill(buffer, 3))
        checked, wrong = wall(lambda: patterns.first_wrong(buffer, 3))
    print(f"pattern 1 GiB on the GPU: fill {made * 1e3:.2f} ms, compare {checked * 1e3:.2f} ms, wrong={wrong}")


def main() -> None:
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    for label in ("cold", "warm"):
        seconds, tested = wall(lambda: memtest.run(device, 1))
        print(f"memtest ({label}): {seconds:.3f} s for {tested.tested_bytes / 2**30:.1f} GiB of "
              f"{tested.free_bytes / 2**30:.1f} GiB free ({tested.allocate_seconds:.3f} s taking and giving back the "
              f"memory), {len(tested.wrong)} wrong")
    pattern_costs(torch.empty(1 << 30, dtype=torch.uint8, device=device))
    for _ in range(2):
        copy, (rate, wrong) = wall(lambda: gpu_proof.device_copy_bytes_per_s(device, seed=5))
    print(f"hbm copy check: {copy * 1e3:.1f} ms in all, {rate / 1e12:.2f} TB/s, wrong={wrong}")
    for _ in range(2):
        copies = gpu_proof.HostCopies(device, 9)
        prepare, _ = wall(copies.prepare)
        h2d, (h2d_rate, _, h2d_wrong) = wall(copies.to_device)
        d2h, d2h_rate = wall(copies.to_host)
        check, d2h_wrong = wall(copies.check_host)
    print(f"host copies: prepare (CPU fill 512 MiB) {prepare * 1e3:.1f} ms, h2d+check {h2d * 1e3:.1f} ms "
          f"({h2d_rate / 1e9:.1f} GB/s), d2h {d2h * 1e3:.1f} ms ({d2h_rate / 1e9:.1f} GB/s), CPU check "
          f"{check * 1e3:.1f} ms; wrong={h2d_wrong},{d2h_wrong}")


if __name__ == "__main__":
    main()
