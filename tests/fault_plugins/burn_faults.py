"""Faults that appear only after a stretch of sustained load, installed from outside the suite for the burn-in
tier: a test (or tests/fault_plugins/prove_burn.sh on a GPU machine) writes a one-line pytest plugin that does
`from burn_faults import *` and calls install(). The clock starts at the soak's first product (the first 2-D
torch.matmul into `out=` once the first burn-in check is set up; the thermal fault alone: at that set-up), so the
fast tier's checks before it see a healthy machine and a slow set-up on a loaded host moves no fault into the
soak's first sustained seconds.

  gemm-wrong-after   every 2-D torch.matmul into `out=` comes out wrong in one element: a GPU that computes
                     right while cool and wrong once hot
  sag-after          every 2-D torch.matmul into `out=` queues two extra products behind it on the same stream
                     (the rate falls to about a third); on a CPU rank it is held back CPU_PAUSE_S instead
  thermal-after      NVML's clock-event reasons gain HW thermal slowdown (0x40)
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

# sag-after on a CPU rank: each product held back SAG_FACTOR - 1 times its own time, and at least CPU_PAUSE_S: its rate
# falls 10-fold whatever the host's load (a fixed pause made it fall only 4-fold once a loaded CI host had slowed
# the products, inside --burn-sag 0.8).
CPU_PAUSE_S, SAG_FACTOR = 0.1, 10
STARTED: list[float] = []  # on this rank: the first burn-in check's set-up, then the soak's first product
FAULTS: dict = {}


def fault(name):
    def register(patch):
        FAULTS[name] = patch
        return patch
    return register


def install(names, rank: int = 0, after_s: float = 10.0) -> None:
    """Patch the libraries with each named fault, on `rank` only, active `after_s` seconds into the soak."""
    for name in names:
        FAULTS[name](rank, after_s)


def pytest_runtest_setup(item) -> None:
    if not STARTED and item.nodeid.split("::")[0].endswith("test_10_burn.py"):
        STARTED.append(time.monotonic())


def _active(rank: int, after_s: float) -> bool:
    mine = dist.get_rank() == rank if dist.is_initialized() else rank == 0
    return mine and bool(STARTED) and time.monotonic() - STARTED[-1] >= after_s


def _patch_matmul(spoil) -> None:
    real = torch.matmul

    @functools.wraps(real)
    def matmul(a, b, *, out=None):
        if len(STARTED) == 1 and out is not None:
            STARTED.append(time.monotonic())
        start = time.perf_counter()
        result = real(a, b, out=out) if out is not None else real(a, b)
        if out is not None and a.dim() == 2 and b.dim() == 2:
            spoil(real, a, b, out, time.perf_counter() - start)
        return result
    torch.matmul = matmul


@fault("gemm-wrong-after")
def _gemm_wrong_after(rank, after_s):
    def spoil(_real, _a, _b, out, _took):
        if _active(rank, after_s):
            out[1, 2] += 1
    _patch_matmul(spoil)


@fault("sag-after")
def _sag_after(rank, after_s):
    scratch = {}

    def spoil(real, a, b, out, took):
        if not _active(rank, after_s):
            return
        if not out.is_cuda:  # a CPU rank's rate varies with the host's load more than extra work would show
            time.sleep(max(CPU_PAUSE_S, (SAG_FACTOR - 1) * took))
            return
        extra = scratch.setdefault((out.shape, out.dtype, out.device), torch.empty_like(out))
        for _ in range(2):
            real(a, b, out=extra)
    _patch_matmul(spoil)


@fault("thermal-after")
def _thermal_after(rank, after_s):
    import pynvml

    real = pynvml.nvmlDeviceGetCurrentClocksEventReasons

    @functools.wraps(real)
    def reasons(handle):
        found = real(handle)
        return found | 0x40 if _active(rank, after_s) else found
    pynvml.nvmlDeviceGetCurrentClocksEventReasons = reasons
