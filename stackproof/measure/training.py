"""Pieces of the end-to-end DDP ResNet-50 check: a synthetic dataset, digests to compare ranks bit for bit,
a step, and a timed benchmark."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time
from collections.abc import Iterable

import torch

from stackproof.judge import training as judged

NUM_CLASSES = 1000


@dataclasses.dataclass(frozen=True)
class TrainShape:
    batch: int  # per rank
    image_size: int
    dtype: torch.dtype  # autocast dtype on GPU; float32 on CPU

    @classmethod
    def for_device(cls, is_gpu: bool, batch: int | None, image_size: int | None) -> TrainShape:
        if is_gpu:
            return cls(batch or 256, image_size or 224, torch.bfloat16)
        return cls(batch or 4, image_size or 64, torch.float32)


class SyntheticImages(torch.utils.data.Dataset):
    """`samples` images and labels, each made from its own index on demand: the same sample on every rank, and
    a rank holds only what it reads (memory stays flat whatever the world size)."""

    def __init__(self, samples: int, image_size: int, seed: int = 0):
        self.samples, self.image_size, self.seed = samples, image_size, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.samples:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.image_size, self.image_size, generator=generator)
        return image, torch.randint(0, NUM_CLASSES, (), generator=generator)

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = zip(*(self[i] for i in indices), strict=True)
        return torch.stack(images), torch.stack(labels)


def shard_summary(shard: list[int], size: int) -> dict[str, int | bool]:
    """What rank 0 needs to prove the shards disjoint and covering without seeing them: their size, whether
    every index is in range and unique within the shard, and a sum of per-index fingerprints."""
    return {"count": len(shard), "in_range": all(0 <= i < size for i in shard), "unique": len(set(shard)) == len(shard),
            "fingerprint": sum(judged.fingerprint(i) for i in shard) & judged.MASK}


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the exact bytes: equal digests mean bit-identical tensors."""
    hasher = hashlib.sha256()
    flat = [tensor.detach().reshape(-1).float() for tensor in tensors]
    if flat:  # one copy to the host and no copy into bytes (ResNet-50's 100 MB: not 161 synchronised copies)
        hasher.update(torch.cat([t.to(flat[0].device) for t in flat]).cpu().numpy())
    return hasher.hexdigest()[:16]


def per_tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """[(name, digest)] so ranks can name the first tensor that differs without another collective."""
    return [(name, digest([tensor])) for name, tensor in named]


def first_difference(mine: list[tuple[str, str]], reference: list[tuple[str, str]]) -> str:
    for (name, ours), (_, theirs) in zip(mine, reference, strict=True):
        if ours != theirs:
            return name
    return "none"


def state_bytes(model: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def train_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
               autocast: torch.dtype | None):
    """(forward_backward, step): one pass of cross-entropy loss and its gradients (autocast to `autocast` when
    given), and that pass followed by the optimizer's step."""

    def forward_backward() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(module(images), labels)
        loss.backward()
        return loss

    def step() -> None:
        forward_backward()
        optimizer.step()

    return forward_backward, step


def images_per_second(step, batch: int, steps: int, device: torch.device) -> float:
    """Time `steps` back-to-back calls of `step()` after the caller's warm-up."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return batch * steps / (time.perf_counter() - begin)


# --- One DDP step against a single-process reference: a small network, so every rank can compute the reference
# on the whole global batch in a moment (ResNet-50 on CPU would take minutes per rank) --------------------------

REFERENCE_SEED = 1000  # rank r builds its network from seed REFERENCE_SEED + r: DDP's broadcast must fix that
REFERENCE_BATCH, REFERENCE_IMAGE, REFERENCE_CLASSES, REFERENCE_LR = 4, 16, 10, 0.1


class SmallNet(torch.nn.Sequential):
    """Two convolutions with BatchNorm (running statistics are buffers DDP broadcasts) and a linear head."""

    def __init__(self):
        nn = torch.nn
        super().__init__(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, REFERENCE_CLASSES))


def small_net(seed: int) -> SmallNet:
    """Built on the CPU from `seed` without touching the global generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmallNet()


def reference_shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = SyntheticImages(world * REFERENCE_BATCH, REFERENCE_IMAGE, seed=1)
    images, labels = images.batch(range(rank * REFERENCE_BATCH, (rank + 1) * REFERENCE_BATCH))
    return images, labels % REFERENCE_CLASSES


def sgd_step(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, optimizer=None) -> None:
    """Forward in training mode, cross-entropy, backward; and the optimizer's step when given one."""
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    if optimizer is not None:
        optimizer.step()


@dataclasses.dataclass
class ReferenceStep:
    params: dict[str, torch.Tensor]  # float64, after the step
    magnitude: dict[str, torch.Tensor]  # mean over shards of each gradient's sum of |terms|
    buffers: list[dict[str, torch.Tensor]]  # each shard's BatchNorm buffers after its forward, float64
    buffer_magnitude: list[dict[str, torch.Tensor]]  # each shard's: what its running statistics' sums add


BN_EPS, BN_MOMENTUM = 1e-5, 0.1  # nn.BatchNorm2d's defaults, which SmallNet keeps


def _conv3x3(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A 3x3 convolution with padding 1 by formula: nine shifted einsums, no convolution kernel."""
    batch, channels, height, width = x.shape
    padded = x.new_zeros(batch, channels, height + 2, width + 2)
    padded[:, :, 1:-1, 1:-1] = x
    rows, cols = (height - 1) // stride + 1, (width - 1) // stride + 1
    out = 0
    for i in range(3):
        for j in range(3):
            patch = padded[:, :, i:i + stride * (rows - 1) + 1:stride, j:j + stride * (cols - 1) + 1:stride]
            out = out + torch.einsum("bchw,oc->bohw", patch, weight[:, :, i, j])
    return out


def _batch_norm(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, gamma, beta):
    """Training-mode BatchNorm by formula: the batch's (biased) statistics normalise, (xhat, y)."""
    xhat = (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + BN_EPS)
    return xhat, xhat * gamma[:, None, None] + beta[:, None, None]


def _shard_reference(start: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor):
    """One shard's forward and backward through SmallNet in float64 by formula (no conv2d, batch_norm, linear or
    cross_entropy kernel: a kernel fault on the ranks cannot hide here). Returns the gradients, each gradient's
    magnitude (the same sum over |terms|: sum |input| x |grad of output| over batch and positions, which bounds
    how far any float32 summation order may land), the BatchNorm buffers after the forward and their magnitudes."""
    w = {name: start[name].double().requires_grad_() for name in dict(SmallNet().named_parameters())}
    x = images.double()
    saved, buffers, buffer_magnitude = {}, {}, {}
    for conv, bn, stride in (("0", "1", 1), ("3", "4", 2)):
        out = _conv3x3(x, w[f"{conv}.weight"], stride)
        # What the rank's float32 sums over the batch add for the statistics: |out| bounded by the same
        # convolution over |input| and |weight|, so the input's own rounding is inside too.
        out_abs = _conv3x3(x.detach().abs(), w[f"{conv}.weight"].detach().abs(), stride)
        count = out.numel() // out.shape[1]
        mean, var = out.mean((0, 2, 3)), out.var((0, 2, 3), unbiased=False)
        mean_, var_ = mean.detach(), var.detach()
        for_var = ((out_abs + mean_.abs()[:, None, None]) ** 2).mean((0, 2, 3)) * count / (count - 1)
        buffers |= {f"{bn}.running_mean": BN_MOMENTUM * mean_,
                    f"{bn}.running_var": (1 - BN_MOMENTUM) + BN_MOMENTUM * var_ * count / (count - 1),
                    f"{bn}.num_batches_tracked": torch.tensor(1, dtype=torch.int64)}
        buffer_magnitude |= {f"{bn}.running_mean": BN_MOMENTUM * out_abs.mean((0, 2, 3)),
                             f"{bn}.running_var": BN_MOMENTUM * for_var,
                             f"{bn}.num_batches_tracked": torch.zeros((), dtype=torch.float64)}
        xhat, y = _batch_norm(out, mean, var, w[f"{bn}.weight"], w[f"{bn}.bias"])
        saved[conv], saved[bn] = (x, out), (xhat, y)
        out.retain_grad()
        y.retain_grad()
        x = y.clamp(min=0)
    pooled = x.mean((2, 3))
    logits = pooled @ w["8.weight"].T + w["8.bias"]
    logits.retain_grad()
    shifted = logits - logits.amax(1, keepdim=True)
    log_probs = shifted - torch.log(torch.exp(shifted).sum(1, keepdim=True))
    (-log_probs[torch.arange(len(labels)), labels].mean()).backward()

    magnitude = {}
    for conv, stride in (("0", 1), ("3", 2)):
        inputs, out = saved[conv]
        dy = out.grad.abs()
        padded = inputs.new_zeros(*inputs.shape[:2], inputs.shape[2] + 2, inputs.shape[3] + 2)
        padded[:, :, 1:-1, 1:-1] = inputs.detach().abs()
        rows, cols = dy.shape[2], dy.shape[3]
        taps = [[torch.einsum("bchw,bohw->oc", padded[:, :, i:i + stride * (rows - 1) + 1:stride,
                                                      j:j + stride * (cols - 1) + 1:stride], dy)
                 for j in range(3)] for i in range(3)]
        magnitude[f"{conv}.weight"] = torch.stack([torch.stack(row, -1) for row in taps], -2)
    for bn in ("1", "4"):
        xhat, y = saved[bn]
        magnitude[f"{bn}.weight"] = (y.grad.abs() * xhat.detach().abs()).sum((0, 2, 3))
        magnitude[f"{bn}.bias"] = y.grad.abs().sum((0, 2, 3))
    magnitude["8.weight"] = logits.grad.abs().T @ pooled.detach().abs()
    magnitude["8.bias"] = logits.grad.abs().sum(0)
    grads = {name: value.grad for name, value in w.items()}
    return grads, magnitude, buffers, buffer_magnitude


def reference_step(world: int) -> ReferenceStep:
    """One SGD step as DDP defines it, in float64 on the CPU by formula: rank 0's initial network, each rank's
    shard forward and backward on its own (BatchNorm normalises with the shard's statistics, as on its rank), the
    gradients averaged over the shards, p - lr x mean."""
    start = small_net(REFERENCE_SEED).state_dict()
    grads, magnitudes, buffers, buffer_magnitudes = {}, {}, [], []
    for rank in range(world):  # O(world) small steps; memory stays at one network
        shard_grads, magnitude, shard_buffers, buffer_magnitude = _shard_reference(start, *reference_shard(rank, world))
        for name, grad in shard_grads.items():
            grads[name] = grads.get(name, 0) + grad
            magnitudes[name] = magnitudes.get(name, 0) + magnitude[name]
        buffers.append(shard_buffers)
        buffer_magnitudes.append(buffer_magnitude)
    params = {name: start[name].double() - REFERENCE_LR * grads[name] / world for name in grads}
    return ReferenceStep(params, {name: total / world for name, total in magnitudes.items()}, buffers,
                         buffer_magnitudes)


@dataclasses.dataclass(frozen=True)
class Off:
    """A tensor against its float64 reference: the worst error over its bound (`ratio`), how many of its `count`
    elements are beyond their bound (`beyond`), and the element furthest beyond (flat index, found, expected,
    bound)."""
    ratio: float
    beyond: int
    count: int
    index: int
    found: float
    expected: float
    bound: float


def off(found: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> Off:
    error = (found.detach().cpu().double() - want.double()).abs().reshape(-1)
    if not error.numel():
        return Off(0.0, 0, 0, 0, 0.0, 0.0, 0.0)
    bound = bound.reshape(-1)
    worst = int((error - bound).argmax())
    return Off(float((error / bound.clamp(min=1e-300)).max()), int((error > bound).sum()), error.numel(), worst,
               found.reshape(-1)[worst].item(), want.reshape(-1)[worst].item(), bound[worst].item())
