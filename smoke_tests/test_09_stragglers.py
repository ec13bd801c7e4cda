"""Stragglers: per rank, the time from a common start to its arrival at each collective phase and at the DDP step's
gradient sync (its own work: GEMMs, or forward + backward without the sync). A rank more than
--straggler-tolerance slower than the others (the median of the other ranks' times) is named with its host and
GPU; stackproof/judge/stragglers.py decides."""

import contextlib
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stackproof.judge import stragglers as judged
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import stragglers
from stackproof.run import faults

# Not promised: ranks that share CPU cores, or one GPU (emulated nodes), have no one to be compared with.
pytestmark = pytest.mark.check(FULL, Needs(ranks=2),
                               optional="ranks that share CPU cores or one GPU have no one to be "
                               "compared with")
REPS = 5
PHASES = ["all_reduce", "all_gather", "broadcast", "ddp_step"]


def _barrier(dist_env) -> None:
    dist.barrier(device_ids=[dist_env.device.index] if dist_env.is_gpu else None)


def _collective(name: str, device: torch.device):
    buffer = torch.ones(1 << 20, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(buffer)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(torch.empty(buffer.numel() * dist.get_world_size(),
                                                               device=device), buffer)
    return lambda: dist.broadcast(buffer, src=0)


def _ddp_step(dist_env):
    """A small convolutional net under DDP: the rank's own work is forward + backward without the gradient sync
    (no_sync); the sync is the step's collective."""
    torch.manual_seed(0)
    side = 64 if dist_env.is_gpu else 32
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    ddp = DistributedDataParallel(model.to(dist_env.device),
                                  device_ids=[dist_env.device.index] if dist_env.is_gpu else None)
    images = torch.randn(64 if dist_env.is_gpu else 8, 3, side, side, device=dist_env.device)

    def own_work():
        with ddp.no_sync():
            ddp(images).sum().backward()
        if dist_env.is_gpu:
            torch.cuda.synchronize(dist_env.device)

    def sync():
        ddp(images).sum().backward()  # the same step, now with DDP's gradient all_reduce

    return own_work, sync


@pytest.fixture
def stack():
    with contextlib.ExitStack() as contexts:
        yield contexts


@pytest.mark.parametrize("phase", PHASES)
def test_no_rank_arrives_late(phase, dist_env, settings, report, stack):
    if phase == "ddp_step":
        # No cuDNN autotuning (the ResNet check turned it on): it would spend seconds tuning this small net.
        stack.enter_context(torch.backends.cudnn.flags(enabled=True, benchmark=False))
        work, collective = _ddp_step(dist_env)
    else:
        work, collective = stragglers.gemm_work(dist_env.device), _collective(phase, dist_env.device)
    tolerance = settings.straggler_tolerance_on(dist_env.is_gpu)
    slow_down = faults.work_slow_down(settings, dist_env)
    work()  # warm-up: first-call costs (allocations, cuBLAS handles) are no rank's fault
    collective()
    arrivals, waits = [], []
    for _ in range(REPS):
        _barrier(dist_env)
        arrivals.append(stragglers.timed(work, slow_down))
        begin = time.perf_counter()
        collective()
        if dist_env.is_gpu:
            torch.cuda.synchronize(dist_env.device)
        waits.append(time.perf_counter() - begin)
    # The best of the repetitions: a neighbour's burst on a shared host should not name a rank; a slow GPU or
    # node is slow every time.
    mine = {"arrival": min(arrivals), "wait": statistics.median(waits),
            "gpu": str(torch.cuda.get_device_properties(dist_env.device).uuid) if dist_env.is_gpu else None}
    verdict = dist_env.agree(mine, f"the {phase} arrival times", lambda values: {
        **judged.late_ranks([v["arrival"] for v in values], tolerance or 0.0, [v["gpu"] for v in values]),
        "rows": [{"rank": r, "arrival_ms": round(v["arrival"] * 1e3, 3), "wait_ms": round(v["wait"] * 1e3, 3)}
                 for r, v in enumerate(values)]})
    report.figure("arrival", round(mine["arrival"] * 1e3, 3), "ms")
    report.figure("wait", round(mine["wait"] * 1e3, 3), "ms")
    report.figure("median_arrival", round(verdict["median"] * 1e3, 3), "ms")
    report.table(f"stragglers_{phase}", verdict["rows"])
    if tolerance is None:
        pytest.skip("CPU ranks share this host's cores: their timings are reported above, not judged; pass "
                    "--straggler-tolerance to judge them")
    if dist_env.rank not in verdict["judged"]:
        pytest.skip("every other rank shares this rank's GPU (emulated nodes): the GPU's time-slicing, not a rank, "
                    "decides who finishes first; measured, not judged")
    gpu = dist_env.gpu_index
    return Judged([judged.late(phase, slow, tolerance, gpu) for slow in verdict["slow"]
                   if slow["rank"] == dist_env.rank], hint=judged.LATE_FIX, where=dist_env.node)
