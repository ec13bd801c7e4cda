"""A small decoder block (RMSNorm, causal multi-head attention through scaled_dot_product_attention, RMSNorm, SiLU
MLP) trained one step under DDP or FSDP2 with gradient accumulation, autocast (and a GradScaler on fp16) and
AdamW; and the same step in float64 on the CPU by formula, sharing none of those kernels."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from stackproof.judge import optimizers as optimizer_reference
from stackproof.judge import transformer as judged


class Block(nn.Module):
    def __init__(self, shape: judged.Shape):
        super().__init__()
        self.heads = shape.heads
        self.norm1, self.norm2 = nn.RMSNorm(shape.dim), nn.RMSNorm(shape.dim)
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim, bias=False)
        self.proj = nn.Linear(shape.dim, shape.dim, bias=False)
        self.up = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.down = nn.Linear(shape.hidden, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.silu(self.up(self.norm2(x))))


def block(shape: judged.Shape = judged.SHAPE) -> Block:
    """The same float32 weights on every rank (and in the reference): one seed."""
    torch.manual_seed(shape.seed)
    return Block(shape)


def micro_batch(shape: judged.Shape, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `micro`: inputs and regression targets, its own on each rank."""
    generator = torch.Generator().manual_seed(shape.seed * 1000 + rank * shape.micro_batches + micro)
    size = (shape.batch, shape.seq, shape.dim)
    return torch.randn(size, generator=generator), torch.randn(size, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


def step(mode: str, precision: str, shape: judged.Shape, rank: int, device: torch.device):
    """One optimizer step of `shape.micro_batches` micro-batches on this rank under DDP or FSDP2. Returns the
    model's float32 weights before the step (full), the averaged gradients (full, after unscaling) and the weights
    after the step (full), on the CPU."""
    model = block(shape).to(device)
    before = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

        def accumulating(last: bool):
            return contextlib.nullcontext() if last else wrapped.no_sync()
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.qkv, model.proj, model.up, model.down):
            fully_shard(layer)
        wrapped = fully_shard(model)

        @contextlib.contextmanager
        def accumulating(last: bool):
            wrapped.set_requires_gradient_sync(last)
            yield
    dtype = None if precision == "float32" else getattr(torch, precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "float16" else None
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=shape.lr, weight_decay=shape.weight_decay)
    for micro in range(shape.micro_batches):
        inputs, targets = (t.to(device) for t in micro_batch(shape, rank, micro))
        with accumulating(micro == shape.micro_batches - 1):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = _loss(wrapped(inputs), targets) / shape.micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    after = {name: _full(p) for name, p in model.named_parameters()}
    return before, grads, after


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shard) gathered whole; a plain tensor as it is; on the CPU."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().float().cpu()


def reference_gradients(shape: judged.Shape, world: int, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The averaged gradient of the loss over every rank's every micro-batch, in float64 on the CPU by formula:
    no scaled_dot_product_attention, no RMSNorm or Linear module, no autocast."""
    w = {name: value.double().requires_grad_() for name, value in weights.items()}
    heads, head_dim = shape.heads, shape.dim // shape.heads
    eps = torch.finfo(torch.float32).eps  # nn.RMSNorm's default eps: the float32 input's

    def norm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    total = 0
    mask = torch.ones(shape.seq, shape.seq, dtype=torch.bool).triu(1)
    for rank in range(world):
        for micro in range(shape.micro_batches):
            x, target = (t.double() for t in micro_batch(shape, rank, micro))
            qkv = norm(x, w["norm1.weight"]) @ w["qkv.weight"].T
            q, k, v = qkv.view(shape.batch, shape.seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(mask, float("-inf"))
            weights_ = torch.exp(scores - scores.amax(-1, keepdim=True))
            attended = (weights_ / weights_.sum(-1, keepdim=True)) @ v
            x = x + attended.transpose(1, 2).reshape(shape.batch, shape.seq, shape.dim) @ w["proj.weight"].T
            hidden = norm(x, w["norm2.weight"]) @ w["up.weight"].T
            out = x + (hidden / (1 + torch.exp(-hidden))) @ w["down.weight"].T
            total = total + ((out - target) ** 2).mean()
    (total / (world * shape.micro_batches)).backward()
    return {name: value.grad for name, value in w.items()}


def worst_rows(found: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float) -> dict[str, tuple]:
    """Per tensor: the largest row error norm / (bound x max(the row's reference norm, the RMS row norm)), and
    the row it is in."""
    worst = {}
    for name, reference in want.items():
        rows = reference.reshape(reference.shape[0], -1) if reference.dim() > 1 else reference.reshape(1, -1)
        error = (found[name].double().reshape(rows.shape) - rows).norm(dim=1)
        scale = rows.norm(dim=1).clamp(min=float(rows.norm(dim=1).pow(2).mean().sqrt()))
        ratio = error / (bound * scale)
        worst[name] = (float(ratio.max()), int(ratio.argmax()))
    return worst


def reference_step(shape: judged.Shape, weights, grads) -> tuple[dict, dict]:
    """AdamW's step from a fresh state on the given gradients, by formula (judge/optimizers.py), with its change."""
    settings = {**optimizer_reference.SETTINGS["AdamW"], "lr": shape.lr, "weight_decay": shape.weight_decay}
    stepped, moved = {}, {}
    for name, weight in weights.items():
        stepped[name], moved[name] = optimizer_reference.reference(
            "AdamW", weight.double(), [grads[name].double()], settings=settings)
    return stepped, moved
