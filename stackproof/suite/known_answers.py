"""Collective inputs whose exact result is known in every dtype (as nccl-tests does): small integers for
sums, powers of two for products, so no rounding can hide a wrong byte."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def rank_input(op: str, rank: int, world: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s contribution: exact in `dtype`, different per rank and per index."""
    i = torch.arange(count, device=device, dtype=torch.int64)
    if op == "sum":
        values = (i + 3 * rank) % 7 + 1  # 1..7: sums stay exact in bf16 up to 36 ranks
    elif op == "avg":
        values = world * ((i + 3 * rank) % 7 + 1)  # multiples of the world size: the mean is an integer
    elif op in ("max", "min"):
        values = (i * 5 + rank * 11) % 13 - 6  # -6..6, signed
    elif op == "product":
        # 1, -1 and (on ranks < 8 only) 2: |product| <= 2**8 whatever the world size
        choice = (i + rank) % 3
        two = 2 if rank < 8 else 1
        values = torch.where(choice == 0, 1, torch.where(choice == 1, two, -1))
    else:
        raise ValueError(op)
    return values.to(dtype)


def expected(op: str, world: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The exact reduction over every rank's input, computed in int64/float64 and cast once."""
    combine = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}
    result = rank_input(op, 0, world, count, torch.int64, device)
    for rank in range(1, world):  # one rank at a time: memory stays at two buffers whatever the world size
        result = combine[op](result, rank_input(op, rank, world, count, torch.int64, device))
    if op == "avg":
        result = result // world
    return result.to(dtype)


def avg_is_exact(world: int) -> bool:
    """NCCL averages floats by multiplying with 1/world: exact only when 1/world is a power of two."""
    return world & (world - 1) == 0


@dataclasses.dataclass(frozen=True)
class Mismatch:
    index: int
    found: float
    expected: float
    wrong: int


def first_mismatch(found: torch.Tensor, want: torch.Tensor, atol_ulp: bool = False) -> Mismatch | None:
    if atol_ulp:
        eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0
        bad = (found.double() - want.double()).abs() > eps * want.double().abs().clamp(min=1)
    else:
        bad = found != want
    wrong = int(bad.sum())
    if not wrong:
        return None
    index = int(bad.nonzero()[0, 0])
    return Mismatch(index, found[index].item(), want[index].item(), wrong)


def check_sizes(max_bytes: int, element_size: int) -> list[int]:
    """Element counts from 1 to max_bytes: odd counts, a count just past a power of two, and the maximum."""
    top = max(1, max_bytes // element_size)
    counts = [1, 3, 17, 1023, 4097, 65537, (1 << 20) + 5, (16 << 20) + 1, top]
    return sorted({c for c in counts if c <= top})
