"""Collective correctness, exact, on every rank: all_reduce over ops x dtypes x sizes x placements, plus
broadcast, all_gather, reduce_scatter and a barrier. Inputs are chosen so the exact answer is known."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from stackproof.suite import faults
from stackproof.suite.known_answers import (
    DTYPES,
    OPS,
    avg_is_exact,
    check_sizes,
    expected,
    first_mismatch,
    rank_input,
)

MiB = 1 << 20
OP_NAMES = list(OPS)
DTYPE_NAMES = list(DTYPES)
# (in place?, element offset): offset 1 makes the buffer start off every vector alignment NCCL likes.
PLACEMENTS = [(True, 0), (True, 1), (False, 1)]
OTHER_DTYPES = ["float32", "bfloat16", "int64"]


def _max_bytes(settings, dist_env) -> int:
    return settings.max_check_bytes or (256 * MiB if dist_env.is_gpu else 16 * MiB)


def _placed(values: torch.Tensor, offset: int) -> torch.Tensor:
    storage = torch.empty(values.numel() + offset, dtype=values.dtype, device=values.device)
    view = storage[offset:]
    view.copy_(values)
    return view


def _sync(dist_env) -> None:
    if dist_env.is_gpu:
        torch.cuda.synchronize()


def test_barrier(dist_env, settings, report):
    report.classify("interconnect", "triage")
    faults.stop_if_asked(settings, dist_env.rank)
    start = time.perf_counter()
    dist.barrier(device_ids=[dist_env.device.index] if dist_env.is_gpu else None)
    report.figure("barrier", round((time.perf_counter() - start) * 1e3, 3), "ms")


def _skip_if_gloo_cannot_average(dtype, device) -> None:
    """Older torch's gloo refuses ReduceOp.AVG on every rank alike, before any data moves (2.7: "Cannot use
    ReduceOp.AVG with Gloo"); newer ones average."""
    try:
        dist.all_reduce(torch.zeros(1, dtype=dtype, device=device), dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as err:
        if "AVG" not in str(err):
            raise
        pytest.skip(f"this torch's gloo cannot average ({err}); NCCL can: covered on GPU runs")


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_all_reduce(op, dtype_name, dist_env, settings, report):
    report.classify("interconnect", "isolate")
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    if op == "avg" and not dtype.is_floating_point and dist_env.backend == "gloo":
        pytest.skip("gloo cannot average integer tensors (NCCL can): covered on GPU runs")
    tolerant = op == "avg" and dtype.is_floating_point and not avg_is_exact(world)
    failures, counts = [], check_sizes(_max_bytes(settings, dist_env), torch.tensor([], dtype=dtype).element_size())
    for count in counts:
        if op == "avg" and dist_env.backend == "gloo" and count == counts[0]:
            _skip_if_gloo_cannot_average(dtype, device)
        want = expected(op, world, count, dtype, device)
        mine = rank_input(op, rank, world, count, dtype, device)
        for in_place, offset in PLACEMENTS:
            buffer = _placed(mine, offset)
            if in_place:
                dist.all_reduce(buffer, OPS[op])
                result = buffer
            else:
                result = funcol.wait_tensor(funcol.all_reduce(buffer, op, dist.group.WORLD))
                if not torch.equal(buffer, mine):
                    failures.append(f"rank {rank}, op {op}, dtype {dtype_name}, count {count}, out-of-place: "
                                    "the input buffer was modified")
            if faults.active(settings, "allreduce-add-one", rank):
                result = result + 1
            bad = first_mismatch(result, want, atol_ulp=tolerant)
            if bad:
                placement = f"{'in-place' if in_place else 'out-of-place'}, offset {offset}"
                failures.append(f"rank {rank}, op {op}, dtype {dtype_name}, count {count} "
                                f"({count * mine.element_size()} B), {placement}: first wrong index {bad.index}: "
                                f"found {bad.found}, expected {bad.expected} ({bad.wrong} wrong)")
        _sync(dist_env)
    report.figure("largest", counts[-1] * torch.tensor([], dtype=dtype).element_size(), "B")
    report.figure("cases", len(counts) * len(PLACEMENTS))
    report.hint("wrong data from NCCL: check the driver/NCCL pair, NCCL_PROTO/NCCL_ALGO overrides, GPU ECC")
    assert not failures, failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")


@pytest.mark.parametrize("dtype_name", OTHER_DTYPES)
def test_broadcast(dtype_name, dist_env, settings, report):
    report.classify("interconnect", "isolate")
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    root = world - 1  # not rank 0: a root-0-only bug would hide otherwise
    failures = []
    for count in check_sizes(_max_bytes(settings, dist_env), 8)[-4:]:
        want = rank_input("sum", root, world, count, dtype, device)
        buffer = _placed(want if rank == root else torch.zeros_like(want), 1)
        dist.broadcast(buffer, src=root)
        bad = first_mismatch(buffer, want)
        if bad:
            failures.append(f"rank {rank}, broadcast from {root}, dtype {dtype_name}, count {count}: first wrong "
                            f"index {bad.index}: found {bad.found}, expected {bad.expected}")
    assert not failures, failures[0]


@pytest.mark.parametrize("dtype_name", OTHER_DTYPES)
def test_all_gather(dtype_name, dist_env, settings, report):
    report.classify("interconnect", "isolate")
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    failures = []
    for count in check_sizes(_max_bytes(settings, dist_env) // world, 8)[-4:]:
        want = torch.cat([rank_input("sum", r, world, count, dtype, device) for r in range(world)])
        output = torch.empty_like(want)
        dist.all_gather_into_tensor(output, rank_input("sum", rank, world, count, dtype, device))
        bad = first_mismatch(output, want)
        if bad:
            failures.append(f"rank {rank}, all_gather, dtype {dtype_name}, count {count} per rank: first wrong "
                            f"index {bad.index} (from rank {bad.index // count}): found {bad.found}, "
                            f"expected {bad.expected}")
    assert not failures, failures[0]


@pytest.mark.parametrize("dtype_name", OTHER_DTYPES)
def test_reduce_scatter(dtype_name, dist_env, settings, report):
    report.classify("interconnect", "isolate")
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    failures = []
    for count in check_sizes(_max_bytes(settings, dist_env) // world, 8)[-4:]:
        full = expected("sum", world, count * world, dtype, device)
        output = torch.empty(count, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(output, rank_input("sum", rank, world, count * world, dtype, device))
        bad = first_mismatch(output, full[rank * count:(rank + 1) * count])
        if bad:
            failures.append(f"rank {rank}, reduce_scatter sum, dtype {dtype_name}, count {count} per rank: first "
                            f"wrong index {bad.index}: found {bad.found}, expected {bad.expected}")
    assert not failures, failures[0]
