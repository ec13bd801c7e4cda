"""Which rank holds the others up. A collective takes as long on every rank as on the slowest (all wait for the
last to arrive), so it is not the collective that is timed but what each rank does before it arrives: its own
work from a common start (a barrier) to its arrival, and, for the record, how long it then waited for the others
(the last to arrive waits least). The decision is stackproof/judge/stragglers.py's."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# The timed work: GEMMs big enough to be timed reliably and small enough to keep the check short.
GEMM_N_GPU, GEMM_N_CPU, GEMMS = 8192, 256, 4


def gemm_work(device: torch.device) -> Callable[[], None]:
    """A fixed amount of this rank's own compute (bf16 on GPU, fp32 on CPU), finished when the call returns."""
    n = GEMM_N_GPU if device.type == "cuda" else GEMM_N_CPU
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def work() -> None:
        for _ in range(GEMMS):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return work


def timed(work: Callable[[], None], slow_down: float = 0.0) -> float:
    """Seconds `work()` takes; `slow_down` (a fault) stretches it by that many times its own time."""
    begin = time.perf_counter()
    work()
    took = time.perf_counter() - begin
    if slow_down:
        time.sleep(slow_down * took)
    return time.perf_counter() - begin
