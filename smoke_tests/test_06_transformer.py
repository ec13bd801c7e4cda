"""A transformer training step end to end: a small decoder block (RMSNorm, causal attention, SiLU MLP) under DDP
and FSDP2 (fully_shard), two micro-batches accumulated (the first under no_sync / without gradient sync), autocast
in bf16 or fp16 (with a GradScaler) or none, and AdamW. Every rank's averaged gradients must equal the gradient
of the whole global batch computed in float64 on the CPU by formula (stackproof/measure/transformer.py: no
kernel under test is shared, so a kernel wrong on every rank shows), and its weights after the step AdamW's step
on those gradients by formula (stackproof/judge/optimizers.py)."""

import pytest
import torch

from stackproof.judge import optimizers
from stackproof.judge import transformer as judged
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import transformer

pytestmark = pytest.mark.check(FULL, Needs())
MODES = [pytest.param(mode, marks=pytest.mark.check(FULL, Needs(api=judged.FSDP2_API)))
         if mode == "fsdp2" else mode for mode in judged.MODES]


@pytest.mark.parametrize("precision", judged.PRECISIONS)
@pytest.mark.parametrize("mode", MODES)
def test_training_step_equals_the_float64_reference(mode, precision, dist_env, report):
    shape, world = judged.SHAPE, dist_env.world_size
    before, grads, after = transformer.step(mode, precision, shape, dist_env.rank, dist_env.device)
    want = transformer.reference_gradients(shape, world, before)
    eps = torch.finfo(getattr(torch, precision)).eps
    worst_grads = transformer.worst_rows(grads, want, judged.row_bound(eps))
    stepped, moved = transformer.reference_step(shape, before, grads)
    eps32 = torch.finfo(torch.float32).eps
    worst_step = {name: (float(((after[name].double() - stepped[name]).abs()
                                / optimizers.bound(stepped[name].abs(), moved[name], eps32, steps=1)).max()), 0)
                  for name in stepped}
    report.figure("worst_gradient_row_over_tolerance", round(max(r for r, _ in worst_grads.values()), 3))
    report.figure("worst_step_over_tolerance", round(max(r for r, _ in worst_step.values()), 3))
    report.figure("global_batch", f"{world} ranks x {shape.micro_batches} micro-batches x {shape.batch}")
    problems = judged.problems(worst_grads, "gradient of") + judged.problems(worst_step, "AdamW step of")
    gpu = dist_env.gpu_index
    return Judged([judged.step_wrong(dist_env.rank, mode, precision, problems, gpu)] if problems else [],
                  hint=judged.STEP_WRONG)
