"""Pieces of the end-to-end DDP ResNet-50 check: a synthetic dataset, digests to compare ranks bit for bit,
a step, and a timed benchmark."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import time
from collections.abc import Iterable

import torch
from torch.utils.data import TensorDataset

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


def synthetic_dataset(samples: int, image_size: int, seed: int = 0) -> TensorDataset:
    """The same images and labels on every rank (same seed), so sampler shards are the only difference."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, image_size, image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (samples,), generator=generator)
    return TensorDataset(images, labels)


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
