"""Pieces of the end-to-end DDP ResNet-50 check: a synthetic dataset, digests to compare ranks bit for bit,
a step, and a timed benchmark."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time
from collections.abc import Iterable

import torch

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


_MASK = (1 << 64) - 1


def _mix(index: int) -> int:
    """splitmix64: a well-spread 64-bit value per index, so sums of them fingerprint a set of indices."""
    z = (index + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def shard_summary(shard: list[int], size: int) -> dict[str, int | bool]:
    """What rank 0 needs to prove the shards disjoint and covering without seeing them: their size, whether
    every index is in range and unique within the shard, and a sum of per-index fingerprints."""
    return {"count": len(shard), "in_range": all(0 <= i < size for i in shard), "unique": len(set(shard)) == len(shard),
            "fingerprint": sum(_mix(i) for i in shard) & _MASK}


def shards_problem(summaries: list[dict[str, int | bool]], size: int) -> str:
    """'' when the ranks' shards are disjoint and cover range(size): counts add up to size, no rank repeats or
    strays, and the fingerprints add up to range(size)'s (a missing index and a duplicate elsewhere would
    have to collide in 64 bits to hide)."""
    bad = [r for r, s in enumerate(summaries) if not (s["in_range"] and s["unique"])]
    if bad:
        return f"rank(s) {bad} hold an index out of range or twice"
    total = sum(int(s["count"]) for s in summaries)
    if total != size:
        return f"the shards hold {total} samples in all, expected {size} (each sample exactly once)"
    if sum(int(s["fingerprint"]) for s in summaries) & _MASK != sum(_mix(i) for i in range(size)) & _MASK:
        return "the shards overlap or miss samples (their fingerprints do not add up to the dataset's)"
    return ""


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the exact bytes: equal digests mean bit-identical tensors."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
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
    mean_abs_grad: dict[str, torch.Tensor]  # mean over shards of |gradient|
    buffers: list[dict[str, torch.Tensor]]  # each shard's BatchNorm buffers after its forward


def reference_step(world: int, device: torch.device) -> ReferenceStep:
    """One SGD step as DDP defines it, in this one process: rank 0's initial network, each rank's shard
    forward and backward on its own (BatchNorm normalises with the shard's statistics, as on its rank), the
    gradients averaged over the shards in float64, p - lr x mean."""
    start = small_net(REFERENCE_SEED).state_dict()
    grads, abs_grads, buffers = {}, {}, []
    for rank in range(world):  # O(world) small steps; memory stays at one network
        model = SmallNet().to(device)
        model.load_state_dict(start)
        images, labels = reference_shard(rank, world)
        sgd_step(model, images.to(device), labels.to(device))
        for name, param in model.named_parameters():
            grads[name] = grads.get(name, 0) + param.grad.double()
            abs_grads[name] = abs_grads.get(name, 0) + param.grad.double().abs()
        buffers.append({name: b.detach().clone() for name, b in model.named_buffers()})
    params = {name: start[name].to(device).double() - REFERENCE_LR * grads[name] / world for name in grads}
    return ReferenceStep(params, {name: total / world for name, total in abs_grads.items()}, buffers)
