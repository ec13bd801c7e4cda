"""A training job's answers, judged: DDP's shards, loss, gradients, parameters and checkpoint agree across ranks,
and one DDP step equals its float64 reference (stackproof/measure/training.py measures; smoke_tests/
test_06_ddp_resnet.py runs them). Pure: what the ranks measured in, findings out.

Whose fault: ranks that disagree after an all_reduce point at the collective's path (a broken NCCL/driver pair or
GPU, to triage); a sampler, a loss or a step off its known answer at the image's software (its kernels, DDP's
hooks), which the check cannot tell apart from the GPU: to triage as well."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from stackproof.judge.findings import Finding, first_of

RANKS_DISAGREE = "DDP's gradient all_reduce gave ranks different answers: a broken NCCL/driver or GPU"
STEP_OFF = ("DDP's step differs from the same step in float64: check the convolution / BatchNorm kernels (the "
            "convolutions check), DDP comm hooks, gradient division (gradient_predivide_factor), the start-up "
            "broadcast (broadcast_buffers, init_sync) and the backend")
SAMPLER = "DistributedSampler's shards: check the image's torch (torch.utils.data.distributed) and set_epoch's use"
LOSS = "the training loop's loss: check the image's kernels (the convolutions and GEMM checks) and the optimizer"
MASK = (1 << 64) - 1


def fingerprint(index: int) -> int:
    """splitmix64: a well-spread 64-bit value per index, so sums of them fingerprint a set of indices."""
    z = (index + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def shards_problem(summaries: Sequence[Mapping[str, int | bool]], size: int) -> str:
    """'' when the ranks' shards (measure/training.py shard_summary) are disjoint and cover range(size): counts add
    up to size, no rank repeats or strays, and the fingerprints add up to range(size)'s (a missing index and a
    duplicate elsewhere would have to collide in 64 bits to hide)."""
    bad = [r for r, s in enumerate(summaries) if not (s["in_range"] and s["unique"])]
    if bad:
        return f"rank(s) {bad} hold an index out of range or twice"
    total = sum(int(s["count"]) for s in summaries)
    if total != size:
        return f"the shards hold {total} samples in all, expected {size} (each sample exactly once)"
    if sum(int(s["fingerprint"]) for s in summaries) & MASK != sum(fingerprint(i) for i in range(size)) & MASK:
        return "the shards overlap or miss samples (their fingerprints do not add up to the dataset's)"
    return ""


def _software(gpu_index: int | None, check: str, expected: str, found: str, fix: str) -> Finding:
    return Finding(gpu_index, "", check, expected, found, "software-pins", "triage", fix)


def shards_wrong(problems: Sequence[str], reshuffled: bool) -> list[Finding]:
    """Each epoch's shards overlap or miss samples (shards_problem's words), or did not reshuffle."""
    found = [_software(None, "DistributedSampler shards", "disjoint shards that cover the dataset",
                       f"epoch {epoch}: {problem}", SAMPLER) for epoch, problem in enumerate(problems) if problem]
    if not reshuffled:
        found.append(_software(None, "DistributedSampler shards", "set_epoch to reshuffle the shards",
                               "the same shards in epochs 0 and 1", SAMPLER))
    return found


def loss_wrong(losses: Sequence[float], gpu_index: int | None) -> list[Finding]:
    """A loss that is not finite, or did not decrease over steps on one fixed batch."""
    if not all(math.isfinite(x) for x in losses):
        return [_software(gpu_index, "training loss", "a finite loss at every step", f"{losses}", LOSS)]
    if not losses[-1] < losses[0]:
        return [_software(gpu_index, "training loss", "a loss that decreases on a fixed batch", f"{losses}", LOSS)]
    return []


def disagrees(what: str, rank: int, gpu_index: int | None, found: str) -> Finding:
    """This rank's `what` (gradients at a step, parameters, the reloaded checkpoint) differs from the others'."""
    return Finding(gpu_index, "", f"DDP {what} across ranks", f"rank {rank}'s {what} equal to every other "
                   "rank's", found, "interconnect", "triage", RANKS_DISAGREE)


def step_off(rank: int, lr: float, unsynced: Sequence[str], offs: Mapping[str, Any],
             gpu_index: int | None) -> list[Finding]:
    """One DDP step against its float64 reference: tensors still unlike rank 0's after DDP's start-up broadcast,
    and the parameters and buffers (measure/training.py Off, by name) with elements beyond their bound."""
    problems = [f"after DDP's start-up broadcast, {len(unsynced)} tensors still differ from rank 0's, first "
                f"{unsynced[0]}"] if unsynced else []
    problems += [f"{name}: {o.beyond} of {o.count} elements off, worst at flat index {o.index}: found {o.found:.8g}, "
                 f"expected {o.expected:.8g} +- {o.bound:.2g}" for name, o in offs.items() if o.beyond]
    if not problems:
        return []
    return [_software(gpu_index, "DDP step against its float64 reference", f"rank {rank} after one DDP step (SGD "
                      f"lr {lr}, ranks seeded apart) within float32's rounding of the reference",
                      first_of(problems, 3), STEP_OFF)]
