"""scaled_dot_product_attention through one chosen backend, forward and backward, and its float64 reference on
the CPU by another path (explicit softmax(Q K^T / sqrt(d)) V and its gradients by formula), with each element's
magnitude for the tolerance (stackproof/judge/attention.py)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from stackproof.judge import attention as judged

BATCH, HEADS = 1, 2  # heads > 1: a kernel wrong for one head shows against the other


def backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


@dataclasses.dataclass
class Reference:
    inputs: tuple[torch.Tensor, ...]  # q, k, v, dout: float64 on the CPU, each exact in the case's dtype
    values: dict[str, torch.Tensor]  # out, dq, dk, dv
    magnitude: dict[str, torch.Tensor]


def reference(case: judged.Case, seed: int) -> Reference:
    """Inputs drawn in float64, rounded to the case's dtype (so the kernel and the reference see the same numbers),
    and the exact attention, its gradients for a random dout, and each element's magnitude."""
    dtype = getattr(torch, case.dtype)
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, case.seq, case.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).double()
                     for _ in range(4))
    scale = 1 / math.sqrt(case.head_dim)
    s = q @ k.transpose(-1, -2) * scale
    if case.causal:
        s = s.masked_fill(torch.ones(case.seq, case.seq, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    out = p @ v
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    values = {"out": out, "dq": ds @ k * scale, "dk": ds.transpose(-1, -2) @ q * scale,
              "dv": p.transpose(-1, -2) @ dout}
    # magnitudes: the same chain over absolute values, with P scaled by g (the scores' rounding, relative to |S|,
    # row-wise), and with P replaced by the mask (what an underflow to the dtype's subnormals may lose)
    g = 1 + 2 * s.masked_fill(s.isinf(), 0).abs().amax(-1, keepdim=True)
    mask = (~s.isinf()).double()
    magnitude = {f"{tensor}{suffix}": value for weights, suffix in ((p * g, ""), (mask, "_underflow"))
                 for tensor, value in _magnitudes(weights, p, q, k, v, dout, scale).items()}
    return Reference((q, k, v, dout), values, magnitude)


def _magnitudes(weights, p, q, k, v, dout, scale) -> dict[str, torch.Tensor]:
    mdp = dout.abs() @ v.abs().transpose(-1, -2)
    mds = weights * (mdp + (p * mdp).sum(-1, keepdim=True))
    return {"out": weights @ v.abs(), "dq": mds @ k.abs() * scale, "dk": mds.transpose(-1, -2) @ q.abs() * scale,
            "dv": weights.transpose(-1, -2) @ dout.abs()}


def measure(name: str, case: judged.Case, ref: Reference, device: torch.device) -> judged.Reading:
    """Run sdpa with only backend `name` allowed, forward and backward; each tensor's worst error / tolerance."""
    from torch.nn.attention import sdpa_kernel

    dtype = getattr(torch, case.dtype)
    q, k, v, dout = (t.to(device, dtype) for t in ref.inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend(name)]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
            out.backward(dout)
    except RuntimeError as err:
        return judged.Reading(case, error=str(err).strip().splitlines()[0][:300] if str(err).strip() else "error")
    found = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    worst, heads = {}, {}
    for tensor in judged.TENSORS:
        want = ref.values[tensor]
        bound = judged.tolerance(want.abs(), ref.magnitude[tensor], ref.magnitude[tensor + "_underflow"], eps, tiny)
        error = (found[tensor].detach().double().cpu() - want).abs()
        ratio = torch.where(bound > 0, error / bound.clamp(min=1e-300), torch.where(error > 0, math.inf, 0.0))
        worst[tensor] = float(ratio.max())
        heads[tensor] = int(ratio.amax(dim=(0, 2, 3)).argmax())
    return judged.Reading(case, worst=worst, head=heads)
