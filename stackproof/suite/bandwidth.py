"""all_reduce bandwidth with nccl-tests' definitions (doc/PERFORMANCE.md there):

  algbw = bytes / time,  busbw = algbw * 2(n-1)/n,  GB = 1e9 bytes,
  time = mean over ranks of (back-to-back iterations timed with CUDA events after warm-up) / iterations.
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
    count = nbytes // torch.tensor([], dtype=dtype).element_size()
    buffer = torch.zeros(count, dtype=dtype, device=device)  # zeros: sums never overflow across iterations
    for _ in range(warmup):
        dist.all_reduce(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(buffer)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        begin = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buffer)
        seconds = (time.perf_counter() - begin) / iters
    # nccl-tests' default: the time averaged over ranks.
    shared = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(shared)
    seconds = shared.item() / world_size
    return Row(nbytes, count, _DTYPE_NAMES.get(dtype, str(dtype)), "sum", seconds * 1e6,
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


def own_nccl_log() -> str | None:
    """This process's NCCL_DEBUG_FILE, with NCCL's %h and %p filled in."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return None
    import socket

    return pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
