"""End to end: torchvision ResNet-50 under DDP with a DistributedSampler over a synthetic dataset.
AMP bf16 + channels_last on GPU; fp32 and small images on CPU so CI stays fast."""

import io
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from stackproof.suite import faults, training

WARMUP_STEPS_GPU = 5


@pytest.fixture(scope="module")
def run(dist_env, settings):
    """Train a few steps on one fixed batch, then checkpoint and benchmark; every rank returns what it saw."""
    torch.manual_seed(0)
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    shape = training.TrainShape.for_device(dist_env.is_gpu, settings.train_batch, settings.train_image_size)
    dataset = training.synthetic_dataset(shape.batch * world * 2, shape.image_size)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    shards = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        shards.append(list(sampler))

    if dist_env.is_gpu:
        torch.backends.cudnn.benchmark = True
    memory_format = torch.channels_last if dist_env.is_gpu else torch.contiguous_format
    model = torchvision.models.resnet50(num_classes=training.NUM_CLASSES).to(device, memory_format=memory_format)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if dist_env.is_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    images, labels = dataset[shards[0][: shape.batch]]
    images = images.to(device, memory_format=memory_format)
    labels = labels.to(device)

    def forward_backward():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=shape.dtype, enabled=dist_env.is_gpu):
            loss = torch.nn.functional.cross_entropy(ddp(images), labels)
        loss.backward()
        return loss

    losses, grad_digests, param_digests = [], [], []
    for _ in range(settings.train_steps):
        losses.append(forward_backward().item())
        if faults.active(settings, "perturb-grad", rank):
            next(model.parameters()).grad.add_(1e-3)
        grad_digests.append(training.digest(p.grad for p in model.parameters()))
        optimizer.step()
        param_digests.append(training.digest(model.parameters()))

    # Checkpoint: saved by rank 0 to a file, read back by every rank (through a broadcast: no shared
    # filesystem is assumed across nodes).
    payload = [None]
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "resnet50.pt"
            path.write_bytes(training.state_bytes(model))
            payload = [path.read_bytes()]
    dist.broadcast_object_list(payload, src=0, device=device if dist_env.is_gpu else None)
    reloaded = torchvision.models.resnet50(num_classes=training.NUM_CLASSES)
    reloaded.load_state_dict(torch.load(io.BytesIO(payload[0]), map_location="cpu", weights_only=True))
    checkpoint_digest = training.digest(reloaded.state_dict().values())
    live_digest = training.digest(model.state_dict().values())

    def step():
        forward_backward()
        optimizer.step()

    for _ in range(WARMUP_STEPS_GPU if dist_env.is_gpu else 1):
        step()
    bench_steps = settings.bench_steps if dist_env.is_gpu else min(settings.bench_steps, 2)
    img_per_s = training.images_per_second(step, shape.batch, bench_steps, device)

    mine = {"shards": shards, "losses": losses, "grads": grad_digests, "params": param_digests,
            "checkpoint": checkpoint_digest, "live": live_digest, "img_per_s": img_per_s,
            "named_params": training.per_tensor_digests(model.named_parameters())}
    everyone = dist_env.exchange(mine, "the DDP ResNet-50 run")
    return {"shape": shape, "size": len(dataset), "everyone": everyone, "mine": mine, "bench_steps": bench_steps}


def test_sampler_shards_are_disjoint_and_cover_the_dataset(run, report):
    everyone, size = run["everyone"], run["size"]
    for epoch in (0, 1):
        shards = [set(r["shards"][epoch]) for r in everyone]
        union = set().union(*shards)
        assert sum(map(len, shards)) == len(union), f"epoch {epoch}: ranks' shards overlap"
        assert union == set(range(size)), f"epoch {epoch}: shards miss {sorted(set(range(size)) - union)[:10]}"
    assert any(r["shards"][0] != r["shards"][1] for r in everyone), "set_epoch did not reshuffle the shards"
    report.figure("samples", size)


def test_loss_is_finite_and_decreasing(run, dist_env, report):
    losses, shape = run["mine"]["losses"], run["shape"]
    per_rank = [r["img_per_s"] for r in run["everyone"]]
    report.figure("loss", f"{losses[0]:.3f}->{losses[-1]:.3f}")
    report.figure("img_per_s_per_rank", round(sum(per_rank) / len(per_rank), 1), "img/s")
    report.figure("img_per_s_total", round(sum(per_rank), 1), "img/s")
    report.context("resnet50", {"batch_per_rank": shape.batch, "image_size": shape.image_size,
                                "dtype": str(shape.dtype).removeprefix("torch."), "losses": losses,
                                "bench_steps": run["bench_steps"], "img_per_s_per_rank": per_rank,
                                "img_per_s_total": sum(per_rank),
                                "channels_last": dist_env.is_gpu})
    assert all(math.isfinite(x) for x in losses), f"loss not finite: {losses}"
    assert losses[-1] < losses[0], f"loss did not decrease on a fixed batch: {losses}"


def test_gradients_are_identical_across_ranks(run, report):
    everyone = run["everyone"]
    for step, reference in enumerate(everyone[0]["grads"]):
        differ = [rank for rank, r in enumerate(everyone) if r["grads"][step] != reference]
        report.hint("DDP's gradient all_reduce gave ranks different answers: a broken NCCL/driver or GPU")
        assert not differ, (f"after backward at step {step}: rank(s) {differ} hold different gradients "
                            f"from rank 0 (digest {reference} vs {everyone[differ[0]]['grads'][step]})")


def test_parameters_are_identical_after_the_step(run, report):
    everyone = run["everyone"]
    differ = [rank for rank, r in enumerate(everyone) if r["params"][-1] != everyone[0]["params"][-1]]
    first = training.first_difference(everyone[differ[0]]["named_params"], everyone[0]["named_params"]) if differ \
        else "none"
    assert not differ, (f"after {len(everyone[0]['params'])} steps rank(s) {differ} hold different parameters "
                        f"from rank 0, first in {first}")


def test_checkpoint_reloads_identically_on_every_rank(run, report):
    everyone = run["everyone"]
    saved = everyone[0]["live"]
    differ = [rank for rank, r in enumerate(everyone) if r["checkpoint"] != saved]
    report.figure("digest", saved)
    assert not differ, f"rank(s) {differ} reloaded rank 0's checkpoint into different weights"
