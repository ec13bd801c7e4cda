"""Collective correctness, exact, on every rank: all_reduce, reduce_scatter and reduce over every op x dtype x
size (odd counts, the mid range 64 KiB..4 MiB in 4 KiB multiples, DDP's 25 MiB bucket) x placement
(reduce_scatter and reduce up to DDP's bucket, every dtype in one check per op), plus broadcast, all_gather and
a barrier; all_to_all_single (even and uneven splits) and send/recv between every pair move seeded byte
patterns checked byte for byte. The inputs' exact answer is known at any world size
(stackproof/judge/known_answers.py); every call on a shape gets fresh data, so a stale buffer shows; and floating
sums hold elements that tell round-to-nearest from truncation."""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from stackproof.judge import data
from stackproof.judge import known_answers as recipe
from stackproof.judge.findings import Finding, Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import pairwise, patterns
from stackproof.measure.known_answers import (
    DTYPES,
    OPS,
    call_window,
    dense_input,
    expected,
    first_mismatch,
    rank_input,
)
from stackproof.run import faults

MiB = 1 << 20
OP_NAMES = list(OPS)
# gloo averages floats only, and older torches' gloo not at all: judged on CPU ranks where it runs, promised on GPUs.
GLOO_AVG = pytest.mark.check(FULL, Needs(),
                             optional="gloo averages floats only, and older torches' gloo not at all",
                             optional_on=("cpu",))
OP_PARAMS = [pytest.param(op, marks=GLOO_AVG) if op == "avg" else op for op in OP_NAMES]
pytestmark = pytest.mark.check(FULL, Needs())
DTYPE_NAMES = list(DTYPES)
# (in place?, element offset): offset 1 makes the buffer start off every vector alignment NCCL likes. Each
# placement is a new call on the same shape, with its own data.
PLACEMENTS = [(True, 0), (True, 1), (False, 1)]
CALLS = 2  # calls per shape for the other collectives: the second must not return the first's data
OTHER_DTYPES = ["float32", "bfloat16", "int64"]
HINT = "wrong data from a collective: check the driver/NCCL pair, NCCL_PROTO/NCCL_ALGO overrides, GPU ECC"


def _max_bytes(settings, dist_env) -> int:
    return settings.max_check_bytes or (256 * MiB if dist_env.is_gpu else 16 * MiB)


def _counts(max_bytes: int, dtype: torch.dtype) -> list[int]:
    return recipe.check_counts(max_bytes, torch.tensor([], dtype=dtype).element_size())


def _placed(values: torch.Tensor, offset: int) -> torch.Tensor:
    storage = torch.empty(values.numel() + offset, dtype=values.dtype, device=values.device)
    view = storage[offset:]
    view.copy_(values)
    return view


def _sync(dist_env) -> None:
    if dist_env.is_gpu:
        torch.cuda.synchronize()


def _ulps(op: str, dtype: torch.dtype, world: int) -> int:
    return recipe.average_tolerance_ulps(world) if op == "avg" and dtype.is_floating_point else 0


def _skip_unsupported(op: str, dtype: torch.dtype, dist_env) -> None:
    """gloo cannot average integers (NCCL can); older torch's gloo refuses ReduceOp.AVG altogether, on every
    rank alike, before any data moves (2.7: "Cannot use ReduceOp.AVG with Gloo")."""
    if op != "avg" or dist_env.backend != "gloo":
        return
    if not dtype.is_floating_point:
        pytest.skip("gloo cannot average integer tensors (NCCL can): covered on GPU runs")
    try:
        dist.all_reduce(torch.zeros(1, dtype=dtype, device=dist_env.device), dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as err:
        if "AVG" not in str(err):
            raise
        pytest.skip(f"this torch's gloo cannot average ({err}); NCCL can: covered on GPU runs")



def _wrong(dist_env, what: str, count: int, found: torch.Tensor, want: torch.Tensor, ulps: int = 0
           ) -> Finding | None:
    bad = first_mismatch(found, want, ulps)
    if bad is None:
        return None
    return data.wrong_values("collective", f"{what}, count {count} ({count * found.element_size()} B)", bad,
                             dist_env.gpu_index)


def _judged(found: list[Finding | None]) -> Judged:
    """One finding a check and rank, as a scheduler's reason counts them: the first wrong case, and how many more
    (every case of a check is the same path, judged the same way)."""
    found = [f for f in found if f]
    if len(found) > 1:
        found = [dataclasses.replace(found[0], found=f"{found[0].found}; and {len(found) - 1} more case(s) wrong")]
    return Judged(found, hint=HINT)


def test_barrier(dist_env, settings, report):
    faults.stop_if_asked(settings, dist_env.rank)
    start = time.perf_counter()
    dist.barrier(device_ids=[dist_env.device.index] if dist_env.is_gpu else None)
    report.figure("barrier", round((time.perf_counter() - start) * 1e3, 3), "ms")


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("op", OP_PARAMS)
def test_all_reduce(op, dtype_name, dist_env, settings, report):
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    _skip_unsupported(op, dtype, dist_env)
    ulps, found, counts = _ulps(op, dtype, world), [], _counts(_max_bytes(settings, dist_env), dtype)
    for count in counts:
        inputs = rank_input(op, rank, world, count + len(PLACEMENTS) - 1, dtype, device)
        answers = expected(op, world, count + len(PLACEMENTS) - 1, dtype, device)
        for call, (in_place, offset) in enumerate(PLACEMENTS):
            mine, want = call_window(inputs, call, count), call_window(answers, call, count)
            buffer = _placed(mine, offset)
            if in_place:
                dist.all_reduce(buffer, OPS[op])
                result = buffer
            else:
                result = funcol.wait_tensor(funcol.all_reduce(buffer, op, dist.group.WORLD))
                if not torch.equal(buffer, mine):
                    found.append(data.wrong_data("collective", f"rank {rank}, op {op}, dtype {dtype_name}, count "
                                                 f"{count}, out-of-place", "its input buffer", "left as it was",
                                                 "changed by the collective", dist_env.gpu_index))
            if faults.active(settings, "allreduce-add-one", rank):
                result = result + 1
            placement = f"{'in-place' if in_place else 'out-of-place'}, offset {offset}, call {call}"
            found.append(_wrong(dist_env, f"rank {rank}, op {op}, dtype {dtype_name}, {placement}", count, result,
                                want, ulps))
        _sync(dist_env)
    report.figure("largest", counts[-1] * torch.tensor([], dtype=dtype).element_size(), "B")
    report.figure("cases", len(counts) * len(PLACEMENTS))
    return _judged(found)


def _dtypes_for(op: str, dist_env) -> list[str]:
    """The dtypes a backend reduces with `op`: gloo cannot average integers (NCCL can: GPU runs cover them)."""
    _skip_unsupported(op, torch.float32, dist_env)
    return [name for name in DTYPE_NAMES
            if not (op == "avg" and dist_env.backend == "gloo" and not DTYPES[name].is_floating_point)]


def _other_max_bytes(settings, dist_env) -> int:
    """reduce_scatter and reduce go up to DDP's bucket: all_reduce alone covers the largest messages."""
    return min(_max_bytes(settings, dist_env), recipe.DDP_BUCKET_BYTES)


@pytest.mark.parametrize("op", OP_PARAMS)
def test_reduce_scatter(op, dist_env, settings, report):
    rank, world, device, found, cases = dist_env.rank, dist_env.world_size, dist_env.device, [], 0
    dtype_names = _dtypes_for(op, dist_env)
    for dtype_name in dtype_names:
        dtype, ulps = DTYPES[dtype_name], _ulps(op, DTYPES[dtype_name], world)
        for count in _counts(_other_max_bytes(settings, dist_env) // world, dtype):
            inputs = rank_input(op, rank, world, count * world + CALLS - 1, dtype, device)
            answers = expected(op, world, count * world + CALLS - 1, dtype, device)
            for call in range(CALLS):
                output = torch.empty(count, dtype=dtype, device=device)
                dist.reduce_scatter_tensor(output, call_window(inputs, call, count * world), op=OPS[op])
                want = call_window(answers, call + rank * count, count)
                found.append(_wrong(dist_env, f"rank {rank}, reduce_scatter {op}, dtype {dtype_name}, call {call}, "
                                    "per rank", count, output, want, ulps))
                cases += 1
            _sync(dist_env)
    report.figure("dtypes", ",".join(dtype_names))
    report.figure("cases", cases)
    return _judged(found)


@pytest.mark.parametrize("op", OP_PARAMS)
def test_reduce(op, dist_env, settings, report):
    rank, world, device, found, cases = dist_env.rank, dist_env.world_size, dist_env.device, [], 0
    root = world - 1  # not rank 0: a root-0-only bug would hide otherwise
    dtype_names = _dtypes_for(op, dist_env)
    for dtype_name in dtype_names:
        dtype, ulps = DTYPES[dtype_name], _ulps(op, DTYPES[dtype_name], world)
        for count in _counts(_other_max_bytes(settings, dist_env), dtype):
            inputs = rank_input(op, rank, world, count + CALLS - 1, dtype, device)
            answers = expected(op, world, count + CALLS - 1, dtype, device) if rank == root else None
            for call in range(CALLS):
                buffer = call_window(inputs, call, count).clone()
                dist.reduce(buffer, dst=root, op=OPS[op])
                if rank == root:
                    found.append(_wrong(dist_env, f"rank {rank} (root), reduce {op}, dtype {dtype_name}, call {call}",
                                        count, buffer, call_window(answers, call, count), ulps))
                cases += 1
            _sync(dist_env)
    report.figure("dtypes", ",".join(dtype_names))
    report.figure("cases", cases)
    return _judged(found)


@pytest.mark.parametrize("dtype_name", OTHER_DTYPES)
def test_broadcast(dtype_name, dist_env, settings, report):
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    root = world - 1
    found = []
    for count in _counts(_max_bytes(settings, dist_env), torch.int64)[-4:]:
        sent = dense_input(root, count + CALLS - 1, dtype, device)
        for call in range(CALLS):
            want = call_window(sent, call, count)
            buffer = _placed(want if rank == root else torch.zeros_like(want), 1)
            dist.broadcast(buffer, src=root)
            found.append(_wrong(dist_env, f"rank {rank}, broadcast from {root}, dtype {dtype_name}, call {call}",
                                count, buffer, want))
    return _judged(found)


@pytest.mark.parametrize("dtype_name", OTHER_DTYPES)
def test_all_gather(dtype_name, dist_env, settings, report):
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    found = []
    for count in _counts(_max_bytes(settings, dist_env) // world, torch.int64)[-4:]:
        sent = [dense_input(r, count + CALLS - 1, dtype, device) for r in range(world)]
        for call in range(CALLS):
            want = torch.cat([call_window(values, call, count) for values in sent])
            output = torch.empty_like(want)
            dist.all_gather_into_tensor(output, call_window(sent[rank], call, count))
            bad = first_mismatch(output, want)
            if bad:
                found.append(data.wrong_values("collective", f"rank {rank}, all_gather, dtype {dtype_name}, call "
                                               f"{call}, count {count} per rank", bad, dist_env.gpu_index,
                                               f"index {bad.index} (from rank {bad.index // count})"))
    return _judged(found)


# --- the data paths of model parallelism: all_to_all (expert / sequence parallelism), send/recv (pipelines) ---

MOVED_COUNTS = (1021, 64 * 1024 + 3)  # elements: an odd count, and one past a 64 Ki boundary


def _segment(sender: int, receiver: int, count: int, dtype: torch.dtype, device, *salt) -> torch.Tensor:
    """What `sender` sends `receiver`: the byte pattern of its own seed, viewed as `dtype` (bytes are compared,
    so a float pattern's NaNs compare like any other bytes)."""
    nbytes = count * torch.tensor([], dtype=dtype).element_size()
    seed = patterns.seed_of("moved", sender, receiver, str(dtype), count, *salt)
    return patterns.made(-(-nbytes // patterns.WORD) * patterns.WORD, seed, device).view(dtype)[:count]


def _splits(world: int, count: int, even: bool) -> list[list[int]]:
    """Elements rank r sends rank d: the same everywhere (even), or different per pair, one of them empty."""
    if even:
        return [[count] * world for _ in range(world)]
    return [[0 if (r + d) % world == 1 else count // (1 + (r + 2 * d) % 3) + d for d in range(world)]
            for r in range(world)]


def _moved_wrong(dist_env, wrong: list[tuple[str, str, object]]) -> Judged:
    return _judged([data.wrong_bytes(path, what, bad, dist_env.gpu_index) for path, what, bad in wrong])


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("splits", ["even", "uneven"])
def test_all_to_all_single(splits, dtype_name, dist_env, report):
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    wrong = []
    for count in MOVED_COUNTS:
        for call in range(CALLS):
            split = _splits(world, count, splits == "even")
            sent = torch.cat([_segment(rank, d, split[rank][d], dtype, device, call) for d in range(world)])
            want = torch.cat([_segment(s, rank, split[s][rank], dtype, device, call) for s in range(world)])
            received = torch.zeros_like(want)
            dist.all_to_all_single(received, sent, output_split_sizes=[split[s][rank] for s in range(world)],
                                   input_split_sizes=split[rank])
            bad = patterns.first_difference(received, want) if want.numel() else None
            if bad is not None:
                element = bad.offset // received.element_size()
                source = next(s for s in range(world) if element < sum(split[x][rank] for x in range(s + 1)))
                wrong.append(("collective", f"all_to_all_single ({splits} splits, {dtype_name}, call {call}): "
                              f"{received.numel() * received.element_size()} B to rank {rank}, the first wrong "
                              f"from rank {source}", bad))
        _sync(dist_env)
    report.figure("counts", ",".join(map(str, MOVED_COUNTS)))
    return _moved_wrong(dist_env, wrong)


@pytest.mark.check(FULL, Needs(ranks=2))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_send_recv_between_every_pair(dtype_name, dist_env, report):
    """Every ordered pair of ranks, both directions at once (a pipeline's activations forward, gradients back),
    scheduled round-robin so every rank is in one pair per round."""
    dtype, rank, world, device = DTYPES[dtype_name], dist_env.rank, dist_env.world_size, dist_env.device
    wrong, pairs = [], 0
    for round_pairs in pairwise.round_robin(world):
        peer = pairwise.peer_in(round_pairs, rank)
        if peer is None:
            continue
        for count in MOVED_COUNTS:
            sent = _segment(rank, peer, count, dtype, device)
            want = _segment(peer, rank, count, dtype, device)
            received = torch.zeros_like(want)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer),
                                                dist.P2POp(dist.irecv, received, peer)]):
                work.wait()
            bad = patterns.first_difference(received, want)
            if bad is not None:
                wrong.append(("send/recv", f"{want.numel() * want.element_size()} B ({dtype_name}) from rank "
                              f"{peer} to rank {rank}", bad))
            pairs += 1
        _sync(dist_env)
    report.figure("exchanges", pairs)
    return _moved_wrong(dist_env, wrong)
