"""Optimizer steps against a float64 reference written out here from the algorithms' definitions (torch.optim's
documentation), so the reference shares no kernel with torch.optim's for-loop, foreach or fused forms. Pure
arithmetic on array-likes (numpy arrays or float64 tensors: + - * / ** only), and the tolerance.

A few steps with a different gradient each, so the state matters (momentum buffer, first and second moments, the
bias corrections' step count): a step that forgets the state, applies weight decay twice or coupled instead of
decoupled, or corrects the bias with the wrong step moves a parameter by lr x a whole update, far outside."""

from __future__ import annotations

from stackproof.judge.findings import Finding
from stackproof.judge.software import known_answer

OPTIMIZERS = ("SGD", "Adam", "AdamW")
FORMS = ("for-loop", "foreach", "fused")
STEPS = 3
# Each optimizer's settings, as torch.optim's keyword arguments.
SETTINGS = {
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "Adam": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
    "AdamW": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
}
# Parameter sizes: a scalar-like one, odd ones, and one past the 65 536-element chunk multi-tensor kernels cut by.
SIZES = (1, 37, 4097, 70001)
OPTIMIZER_ULPS = 8  # roundings per step in an update (moments, sqrt, division, the bias corrections, the product)
# The fused kernels evaluate the bias corrections (1 - beta^step, from a float32 power) and the update in float32
# in their own order, with fused multiply-adds: one H200 (torch 2.11) read 13.7 roundings' worth for fused Adam and
# AdamW, the same on every run; three times the for-loop's keeps a margin, and a wrong step is still thousands
# of times past it (AdamW decaying twice: 4 170 x).
FUSED_ULPS = 3 * OPTIMIZER_ULPS
PARAM_ROUNDINGS = 2  # the parameter rounded per step: AdamW's decay (its factor rounded too), then the update


def form_kwargs(form: str) -> dict[str, bool]:
    """torch.optim's switches for one form."""
    return {"for-loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True, "fused": False},
            "fused": {"fused": True}}[form]


def reference(name: str, param, grads, settings: dict | None = None):
    """The parameter after len(grads) steps from a fresh state, and the sum of |each step's change| (the
    magnitude the tolerance scales with); `settings` in place of SETTINGS[name]."""
    s = settings or SETTINGS[name]
    lr, wd = s["lr"], s["weight_decay"]
    moved = param * 0
    first = second = buffer = None
    for step, grad in enumerate(grads, start=1):
        before = param
        if name == "SGD":
            g = grad + wd * param
            buffer = g if buffer is None else s["momentum"] * buffer + g
            param = param - lr * buffer
        else:
            beta1, beta2 = s["betas"]
            g = grad + wd * param if name == "Adam" else grad
            if name == "AdamW":
                param = param * (1 - lr * wd)
            first = (1 - beta1) * g if first is None else beta1 * first + (1 - beta1) * g
            second = (1 - beta2) * g * g if second is None else beta2 * second + (1 - beta2) * g * g
            m_hat, v_hat = first / (1 - beta1**step), second / (1 - beta2**step)
            param = param - lr * m_hat / (v_hat**0.5 + s["eps"])
        moved = moved + abs(param - before)
    return param, moved


def bound(reference_abs, moved, eps: float, steps: int = STEPS, form: str = "for-loop"):
    """How far a float32 (eps) optimizer's parameter may be from the float64 reference, per element: the
    roundings of the parameter per step (PARAM_ROUNDINGS), and the roundings of each step's change
    (OPTIMIZER_ULPS; FUSED_ULPS for the fused form)."""
    ulps = FUSED_ULPS if form == "fused" else OPTIMIZER_ULPS
    return PARAM_ROUNDINGS * steps * eps * reference_abs + ulps * eps * moved


def step_wrong(name: str, form: str, device: str, worst: float, where: int) -> list[Finding]:
    """A finding when an optimizer's parameter ended more than its tolerance from the reference: `worst` is the
    largest error over the tolerance, in the parameter of index `where` (of SIZES)."""
    if worst <= 1:
        return []
    return [known_answer(f"torch.optim.{name} ({form}, {device})", f"{STEPS} steps from a fresh state",
                         "the float64 reference within the derived tolerance",
                         f"error {worst:.3g}x the tolerance in parameter {where} ({SIZES[where]} elements)")]
