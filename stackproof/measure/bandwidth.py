"""all_reduce bandwidth with nccl-tests' definitions (doc/PERFORMANCE.md there):

  algbw = bytes / time,  busbw = algbw * 2(n-1)/n,  GB = 1e9 bytes,
  time = mean over ranks of (back-to-back iterations timed with CUDA events after warm-up) / iterations.

Eager mode enqueues the iterations while the GPU is held, so the time is the GPU's; graph mode (nccl-tests -G)
replays them from a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import time

import torch
import torch.distributed as dist

GB = 1e9
# The eager timing holds the GPU for ~10 ms at 2 GHz (longer than a size's launches take to enqueue), and holds
# longer if the host still was not done; graph mode launches its graph this often (nccl-tests -G N).
HOLD_CYCLES, HOLD_TRIES = 20_000_000, 3
GRAPH_LAUNCHES = 10
_DTYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16", torch.float64: "double"}


def all_reduce_bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def algbw_gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def busbw_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    return algbw_gbps(nbytes, seconds) * all_reduce_bus_factor(world_size)


def sweep_sizes(min_bytes: int, max_bytes: int, element_size: int = 4) -> list[int]:
    """Sizes from min to max, doubling (nccl-tests -f 2), rounded down to whole elements."""
    sizes, size = [], max(element_size, min_bytes)
    while size <= max_bytes:
        sizes.append(size - size % element_size)
        size *= 2
    return sizes


@dataclasses.dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def time_all_reduce(nbytes: int, world_size: int, device: torch.device, warmup: int, iters: int,
                    dtype: torch.dtype = torch.float32) -> Row:
    """nccl-tests' eager timing: `iters` back-to-back in-place all_reduce, one synchronization."""
    buffer = _zeros(nbytes, dtype, device)
    for _ in range(warmup):
        dist.all_reduce(buffer)
    if device.type == "cuda":
        seconds = _time_held_launches(lambda: dist.all_reduce(buffer), iters, device)
    else:
        begin = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buffer)
        seconds = (time.perf_counter() - begin) / iters
    return _row(nbytes, buffer, seconds, world_size)


def time_all_reduce_graph(nbytes: int, world_size: int, device: torch.device, iters: int,
                          launches: int = GRAPH_LAUNCHES, dtype: torch.dtype = torch.float32) -> Row:
    """nccl-tests -G: `iters` in-place all_reduce captured in one CUDA graph, the graph launched `launches` times
    back to back, one synchronization; the host's per-call work is out of the figure."""
    buffer = _zeros(nbytes, dtype, device)
    graph = capture_all_reduce(buffer, iters)
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        graph.replay()
    end.record()
    end.synchronize()  # no graph launch outstanding when NCCL is next called eagerly (dist.NCCL_GRAPH_MIXING)
    return _row(nbytes, buffer, start.elapsed_time(end) / 1e3 / (iters * launches), world_size)


def capture_all_reduce(buffer: torch.Tensor, count: int) -> torch.cuda.CUDAGraph:
    """`count` all_reduce of `buffer` in a CUDA graph (torch's recipe: a warm-up call on a side stream first)."""
    side = torch.cuda.Stream(buffer.device)
    side.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(side):
        dist.all_reduce(buffer)
    torch.cuda.current_stream(buffer.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: in the default global mode the capture hangs (NCCL's watchdog thread queries CUDA events).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(count):
            dist.all_reduce(buffer)
    return graph


# The data check after each size (nccl-tests checks its timed runs' data too): every rank's float32 elements are
# a shared ramp of whole numbers below RAMP plus a small constant of its own, so the sum is exact in float32 up to
# 2**24 / (RAMP + OWN) ranks, differs per rank, per size and per index, and costs one all_reduce and one compare.
RAMP, RAMP_STRIDE, OWN = 1024, 613, 64


@dataclasses.dataclass(frozen=True)
class WrongSum:
    index: int
    expected: float
    found: float
    wrong: int
    count: int

    def words(self) -> str:
        return (f"element {self.index} of {self.count} (byte {self.index * 4}): expected {self.expected:g}, "
                f"found {self.found:g} ({self.wrong} element(s) wrong)")


def _own(rank: int, salt: int) -> int:
    return (rank * 7 + salt) % OWN


def _ramp(count: int, salt: int, device: torch.device) -> torch.Tensor:
    # modulo RAMP before the multiply: nothing overflows int32 at any count
    ramp = torch.arange(count, dtype=torch.int32, device=device).bitwise_and_(RAMP - 1).add_(salt % RAMP)
    return ramp.mul_(RAMP_STRIDE).bitwise_and_(RAMP - 1)


def fill_known_sum(buffer: torch.Tensor, rank: int, salt: int) -> None:
    """This rank's share of the known-answer all_reduce, written into `buffer` (float32)."""
    buffer.copy_(_ramp(buffer.numel(), salt, buffer.device)).add_(_own(rank, salt))


def wrong_sum(buffer: torch.Tensor, world_size: int, salt: int) -> WrongSum | None:
    """None when `buffer` holds every rank's fill_known_sum summed; else its first wrong element."""
    want = _ramp(buffer.numel(), salt, buffer.device).mul_(world_size).add_(
        sum(_own(rank, salt) for rank in range(world_size)))
    bad = buffer != want
    if not bool(bad.any()):
        return None
    index = int(bad.nonzero()[0, 0])
    return WrongSum(index, float(want[index]), float(buffer[index]), int(bad.sum()), buffer.numel())


def all_reduce_known_answer(nbytes: int, rank: int, world_size: int, device: torch.device,
                            dtype: torch.dtype = torch.float32) -> WrongSum | None:
    """One eager all_reduce of a sweep's size with a known sum, checked."""
    buffer = torch.empty(nbytes // 4, dtype=dtype, device=device)
    fill_known_sum(buffer, rank, nbytes)
    dist.all_reduce(buffer)
    return wrong_sum(buffer, world_size, nbytes)


def graph_all_reduce_known_answer(nbytes: int, rank: int, world_size: int, device: torch.device
                                  ) -> WrongSum | None:
    """One captured all_reduce of a graph sweep's size, replayed on a known sum: what a training step that
    replays a graph gets (the timed graph's repeated in-place sums have no exact float32 answer at any world)."""
    buffer = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device)
    graph = capture_all_reduce(buffer, 1)
    fill_known_sum(buffer, rank, nbytes)  # after the capture's own warm-up call, which reduced it once
    graph.replay()
    torch.cuda.synchronize(device)
    return wrong_sum(buffer, world_size, nbytes)


def graph_unsupported(device: torch.device) -> str:
    """Why this rank cannot capture NCCL calls in a CUDA graph, or '' when it can."""
    if device.type != "cuda":
        return "CUDA graphs need a GPU"
    nccl = torch.cuda.nccl.version()
    if nccl < (2, 9, 6):
        return f"NCCL {'.'.join(map(str, nccl))} cannot be captured in a CUDA graph (needs NCCL >= 2.9.6)"
    return ""


def _time_held_launches(launch, iters: int, device: torch.device) -> float:
    """Seconds per launch, as the GPU saw it. A sleep kernel holds the GPU while the host enqueues every launch:
    torch spends 25-40 us of host time per all_reduce, more than an H200 pair needs for one below 2 MiB
    (6-20 us), so without the hold the figure would be the host's, not the link's (nccl-tests' own launch path
    is lighter). The first launch after the hold lines the ranks up; the timed ones follow it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    hold = HOLD_CYCLES
    for _ in range(HOLD_TRIES):
        held_from, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize(device)
        held_from.record()
        if sleep is not None:
            sleep(hold)
        launch()
        start.record()
        begin = time.perf_counter()
        for _ in range(iters):
            launch()
        enqueued_s = time.perf_counter() - begin
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
        if sleep is None or enqueued_s < held_from.elapsed_time(start) / 1e3:
            return seconds
        hold *= 4  # the host was slower than the hold: the queue ran dry, hold longer
    return seconds


def _zeros(nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # zeros: sums never overflow across iterations
    return torch.zeros(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)


def _row(nbytes: int, buffer: torch.Tensor, seconds: float, world_size: int) -> Row:
    # nccl-tests' default: the time averaged over ranks.
    shared = torch.tensor([seconds], dtype=torch.float64, device=buffer.device)
    dist.all_reduce(shared)
    seconds = shared.item() / world_size
    return Row(nbytes, buffer.numel(), _DTYPE_NAMES.get(buffer.dtype, str(buffer.dtype)), "sum", seconds * 1e6,
               algbw_gbps(nbytes, seconds), busbw_gbps(nbytes, seconds, world_size))


def format_table(rows: list[Row], header: str) -> str:
    """nccl-tests' layout: units in the header, '#' before every line that is not data."""
    lines = [f"# {header}",
             f"# {'size':>12}  {'count':>12}  {'type':>8}  {'redop':>5}  {'time':>9}  {'algbw':>7}  {'busbw':>7}",
             f"# {'(B)':>12}  {'(elements)':>12}  {'':>8}  {'':>5}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}"]
    lines += [f"  {r.size_bytes:>12}  {r.count:>12}  {r.dtype:>8}  {r.redop:>5}  {r.time_us:>9.2f}  "
              f"{r.algbw_gbps:>7.2f}  {r.busbw_gbps:>7.2f}" for r in rows]
    if rows:
        lines.append(f"# Avg bus bandwidth    : {sum(r.busbw_gbps for r in rows) / len(rows):.3f}")
    return "\n".join(lines)


_VIA = re.compile(r" via (\S+)")


def nccl_transports(log_pattern: str) -> set[str]:
    """The transports NCCL reported choosing ('P2P/CUMEM/read', 'SHM/direct/direct', 'NET/IB/0', ...),
    read from its INFO log (NCCL_DEBUG=INFO, NCCL_DEBUG_FILE)."""
    found: set[str] = set()
    for path in glob.glob(log_pattern):
        with open(path, errors="replace") as log:
            for line in log:
                if "Channel" in line:
                    match = _VIA.search(line)
                    if match:
                        found.add(match.group(1))
    return found


def transport_kind(transport: str) -> str:
    """'P2P/CUMEM/read' -> 'P2P'; 'NET/IB/0' -> 'NET'."""
    return transport.split("/")[0]


def own_nccl_log(pattern: str | None) -> str | None:
    """This process's NCCL log: the NCCL_DEBUG_FILE pattern the worker set (or the caller's), %h and %p filled in."""
    if not pattern:
        return None
    import socket

    return pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
