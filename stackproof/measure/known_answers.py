"""Collective inputs whose exact result is known in every dtype at any world size (as nccl-tests does), built on
the device from the pure recipe in stackproof/judge/known_answers.py, and the comparison with that answer."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from stackproof.judge import known_answers as recipe

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def bits_of(dtype: torch.dtype) -> int | None:
    return recipe.significant_bits(torch.finfo(dtype).eps) if dtype.is_floating_point else None


def _index(count: int, device: torch.device) -> torch.Tensor:
    # float64: whole numbers are exact to 2**53 and 2**24 + 1.5 (fp32's rounding element) stays exact
    return torch.arange(count, device=device, dtype=torch.float64)


def rank_input(op: str, rank: int, world: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s contribution: exact in `dtype`, different per rank and per index."""
    values = recipe.contribution(op, rank, world, _index(count, device), bits=bits_of(dtype),
                                 integral=not dtype.is_floating_point)
    return values.to(dtype)


def dense_input(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What rank `rank` sends in a broadcast or all_gather: non-zero almost everywhere."""
    return recipe.dense(rank, _index(count, device)).to(dtype)


def expected(op: str, world: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The exact reduction over every rank's input, rounded once to nearest in `dtype`."""
    return recipe.exact(op, world, _index(count, device), bits=bits_of(dtype),
                        integral=not dtype.is_floating_point).to(dtype)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    index: int
    found: float
    expected: float
    wrong: int


def call_window(values: torch.Tensor, call: int, count: int) -> torch.Tensor:
    """Call `call`'s data on a shape of `count`: the pattern read from index `call` on (`values` holds
    count + calls - 1 elements, made once), so every call on one shape gets different data at no extra cost."""
    return values[call:call + count]


def first_mismatch(found: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> Mismatch | None:
    """The first element more than `ulps` units in the last place from the answer (0: bit for bit)."""
    if ulps and want.is_floating_point():
        eps = torch.finfo(want.dtype).eps
        bad = (found.double() - want.double()).abs() > ulps * eps * want.double().abs().clamp(min=1)
    else:
        bad = found != want
    wrong = int(bad.sum())
    if not wrong:
        return None
    index = int(bad.nonzero()[0, 0])
    return Mismatch(index, found[index].item(), want[index].item(), wrong)


@functools.cache  # one per K class and output precision (fp8's and bf16's alike): the fast tier stays cheap
def gemm_inputs(k: int, output_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (GEMM_ROWS x k), B (k x GEMM_ROWS) and their exact product, float64 on the CPU: whole numbers whose every
    partial sum is exact in `output_dtype` (stackproof/judge/known_answers.py: gemm_stride)."""
    m = recipe.GEMM_ROWS
    stride = recipe.gemm_stride(k, bits_of(output_dtype))
    rows, ks = torch.arange(m, dtype=torch.int64)[:, None], torch.arange(k, dtype=torch.int64)[None, :]
    a = recipe.gemm_a(rows, ks, stride).double()
    b = recipe.gemm_b(ks.T, torch.arange(m, dtype=torch.int64)[None, :]).double()
    return a, b, a @ b
