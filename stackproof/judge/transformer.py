"""A transformer training step judged against a float64 reference that shares none of the kernels under test
(stackproof/measure/transformer.py computes it on the CPU by formula: explicit softmax attention, RMSNorm, SiLU MLP,
and the AdamW step of stackproof/judge/optimizers.py). Pure: shapes, settings and the tolerance.

Gradients are compared row by row (a row of a weight feeds one output feature; the attention projection's rows
are its heads), each row's error norm against CHAIN_ROUNDINGS roundings of the compute precision times the row's
reference norm (or the tensor's root-mean-square row norm, where a row's own is smaller). A first-order bound: each
rounding on the gradient's path (a GEMM's inputs cast to the autocast dtype, its output, P and dS in attention,
the norms' statistics) adds at most one unit of the compute precision, relative, to what flows through it, and the
block's residual paths keep its Jacobians near 1. Gradients summed instead of averaged over the ranks, a micro-batch
lost from the accumulation (no_sync), a GradScaler that does not unscale, or an attention head computed wrong move a
row by a whole part of its norm."""

from __future__ import annotations

import dataclasses

from stackproof.judge.findings import Finding, first_of

MODES = ("ddp", "fsdp2")
PRECISIONS = ("float32", "bfloat16", "float16")  # float32: no autocast; float16: autocast with a GradScaler
CHAIN_ROUNDINGS = 16  # the roundings on a gradient's path through one block, forward and backward (see above)
FSDP2_API = "torch.distributed.fsdp.fully_shard"


@dataclasses.dataclass(frozen=True)
class Shape:
    dim: int = 64
    heads: int = 2
    hidden: int = 128  # the MLP's
    seq: int = 17  # not a multiple of any tile
    batch: int = 2  # per rank per micro-batch
    micro_batches: int = 2  # gradient accumulation: the first under no_sync
    lr: float = 1e-2
    weight_decay: float = 0.1
    seed: int = 97


SHAPE = Shape()


def row_bound(eps: float) -> float:
    """A row's error norm may be this many times its reference norm (floored at the tensor's RMS row norm)."""
    return CHAIN_ROUNDINGS * eps


def problems(worst: dict[str, tuple[float, int]], what: str) -> list[str]:
    """The tensors whose worst row is outside the bound: worst maps a name to (error / bound, the row)."""
    return [f"{what} {name}: row {row} off by {ratio:.3g}x the tolerance" for name, (ratio, row) in worst.items()
            if not ratio <= 1]


STEP_WRONG = ("a training step differs from its float64 reference: an attention / GEMM kernel (see the attention "
              "and GEMM checks), DDP's or FSDP's gradient reduction, no_sync accumulation, or the GradScaler")


def step_wrong(rank: int, mode: str, precision: str, wrong: list[str], gpu_index: int | None) -> Finding:
    """A training step whose gradients or weights left their float64 reference (`wrong`: problems' lines): the
    image's kernels or its parallelism, which the reference cannot tell apart from the GPU's: to triage."""
    return Finding(gpu_index, "", f"{mode} {precision} training step", f"rank {rank}'s gradients and AdamW step "
                   "within their float64 reference's tolerance", first_of(wrong, 4), "software-pins", "triage",
                   STEP_WRONG)
