"""One optimizer (SGD with momentum, Adam, AdamW) in one form (for-loop, foreach, fused) stepped on the run's
device from known float32 parameters and gradients; the float64 reference is stackproof/judge/optimizers.py's."""

from __future__ import annotations

import torch

from stackproof.judge import optimizers as judged


def start(seed: int = 71) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """float32 parameters and each step's gradients (|g| in [0.5, 1.5]: Adam's division stays well conditioned),
    on the CPU; exact in float32, so the float64 reference starts from the same numbers."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(size, generator=generator) for size in judged.SIZES]
    def grad(size):
        signs = torch.randint(0, 2, (size,), generator=generator) * 2 - 1
        return (torch.rand(size, generator=generator) + 0.5) * signs
    grads = [[grad(size) for size in judged.SIZES] for _ in range(judged.STEPS)]
    return params, grads


def step(name: str, form: str, params: list[torch.Tensor], grads: list[list[torch.Tensor]],
         device: torch.device) -> list[torch.Tensor]:
    """The parameters after judged.STEPS steps of torch.optim.<name> in `form` on `device`, back on the CPU.
    Raises what torch.optim raises when this device has no such form (fused on an old torch's CPU)."""
    live = [torch.nn.Parameter(p.to(device, copy=True)) for p in params]  # the CPU start stays as it was
    optimizer = getattr(torch.optim, name)(live, **judged.SETTINGS[name], **judged.form_kwargs(form))
    for step_grads in grads:
        for p, g in zip(live, step_grads, strict=True):
            p.grad = g.to(device)
        optimizer.step()
    return [p.detach().cpu() for p in live]


def worst_ratio(name: str, form: str, params, grads, found) -> tuple[float, int]:
    """The largest |found - reference| / bound over every element, and the parameter it is in."""
    eps = torch.finfo(torch.float32).eps
    worst, where = 0.0, 0
    for index, (p, got) in enumerate(zip(params, found, strict=True)):
        want, moved = judged.reference(name, p.double(), [g[index].double() for g in grads])
        ratio = float(((got.double() - want).abs() / judged.bound(want.abs(), moved, eps, form=form)).max())
        if not ratio <= worst:
            worst, where = ratio, index
    return worst, where
