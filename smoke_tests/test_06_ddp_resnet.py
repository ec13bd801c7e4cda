"""End to end: torchvision ResNet-50 under DDP with a DistributedSampler over a synthetic dataset.
AMP bf16 + channels_last on GPU (cuDNN's heuristic algorithms: autotuning is `stackproof bench resnet`'s); fp32
and small images on CPU so CI stays fast. And one DDP step against a float64 reference on the CPU by formula (a
small BatchNorm network, ranks seeded apart): what every rank agrees on is right too, kernels included."""

import io
import resource
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from stackproof.judge import consensus
from stackproof.judge import known_answers as recipe
from stackproof.judge import training as judged
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import training
from stackproof.run import faults

pytestmark = pytest.mark.check(FULL, Needs())

WARMUP_STEPS_GPU = 5


@pytest.fixture(scope="module")
def run(dist_env, settings):
    """Train a few steps on one fixed batch, then checkpoint and benchmark. Rank 0 judges every rank's digests
    and shard summaries in one O(world) agreement; each check then asserts on the ranks it names."""
    import torchvision  # here, not at the top: its import takes seconds, and --tier fast collects this module

    torch.manual_seed(0)
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    shape = training.TrainShape.for_device(dist_env.is_gpu, settings.train_batch, settings.train_image_size)
    dataset = training.SyntheticImages(shape.batch * world * 2, shape.image_size)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    shards = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        shards.append(list(sampler))

    # cuDNN picks each convolution's algorithm by its heuristics (cudnn.benchmark stays off): autotuning ResNet-50's
    # convolutions, forward and backward, took most of this module's 14.7 s on an H200 and none of its checks
    # needs the fastest algorithm, only a right step (the convolutions check holds cuDNN's answers to a known one);
    # `stackproof bench resnet` autotunes for throughput.
    memory_format = torch.channels_last if dist_env.is_gpu else torch.contiguous_format
    model = torchvision.models.resnet50(num_classes=training.NUM_CLASSES).to(device, memory_format=memory_format)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if dist_env.is_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    images, labels = dataset.batch(shards[0][: shape.batch])
    input_bytes = images.nbytes + labels.nbytes
    images = images.to(device, memory_format=memory_format)
    labels = labels.to(device)

    forward_backward, step = training.train_step(ddp, optimizer, images, labels,
                                                 shape.dtype if dist_env.is_gpu else None)

    losses, grad_digests = [], []
    for _ in range(settings.train_steps):
        losses.append(forward_backward().item())
        if faults.active(settings, "perturb-grad", rank):
            next(model.parameters()).grad.add_(1e-3)
        grad_digests.append(training.digest(p.grad for p in model.parameters()))
        optimizer.step()
    # After the last step only: a difference in an earlier step's parameters shows in a gradient or lasts.
    param_digest = training.digest(model.parameters())

    # Checkpoint: saved by rank 0 to a file, read back by every rank (through a broadcast: no shared
    # filesystem is assumed across nodes).
    payload = [None]
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "resnet50.pt"
            path.write_bytes(training.state_bytes(model))
            payload = [path.read_bytes()]
    dist.broadcast_object_list(payload, src=0, device=device if dist_env.is_gpu else None)
    with torch.device("meta"):  # no initialisation to throw away: the checkpoint's tensors are taken as they are
        reloaded = torchvision.models.resnet50(num_classes=training.NUM_CLASSES)
    reloaded.load_state_dict(torch.load(io.BytesIO(payload[0]), map_location="cpu", weights_only=True), assign=True)
    checkpoint_digest = training.digest(reloaded.state_dict().values())
    live_digest = training.digest(model.state_dict().values())
    del payload, reloaded

    for _ in range(WARMUP_STEPS_GPU if dist_env.is_gpu else 1):
        step()
    bench_steps = settings.bench_steps if dist_env.is_gpu else min(settings.bench_steps, 2)
    img_per_s = training.images_per_second(step, shape.batch, bench_steps, device)

    size = len(dataset)
    mine = {"shards": [training.shard_summary(shard, size) for shard in shards],
            "reshuffled": shards[0] != shards[1], "grads": grad_digests, "params": param_digest,
            "checkpoint": checkpoint_digest, "img_per_s": img_per_s,
            "live": live_digest if rank == 0 else None,
            # Only rank 0's names travel: a differing rank finds its first odd tensor against them.
            "named_params": training.per_tensor_digests(model.named_parameters()) if rank == 0 else None}

    def judge(values):
        return {"shards": [judged.shards_problem([v["shards"][e] for v in values], size) for e in (0, 1)],
                "reshuffled": any(v["reshuffled"] for v in values),
                "grads": [[values[0]["grads"][step], consensus.odd_ones_out([v["grads"][step] for v in values])]
                          for step in range(len(values[0]["grads"]))],
                "params": consensus.odd_ones_out([v["params"] for v in values]),
                "checkpoint": [r for r, v in enumerate(values) if v["checkpoint"] != values[0]["live"]],
                "reference_params": values[0]["named_params"]
                if consensus.odd_ones_out([v["params"] for v in values]) else None,
                "img_per_s_total": sum(v["img_per_s"] for v in values)}

    verdict = dist_env.agree(mine, "the DDP ResNet-50 run", judge)
    return {"shape": shape, "size": size, "mine": mine, "verdict": verdict, "bench_steps": bench_steps,
            "losses": losses, "input_bytes": input_bytes, "model": model,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}



def test_sampler_shards_are_disjoint_and_cover_the_dataset(run, report):
    report.figure("samples", run["size"])
    return Judged(judged.shards_wrong(run["verdict"]["shards"], run["verdict"]["reshuffled"]), hint=judged.SAMPLER)


def test_loss_is_finite_and_decreasing(run, dist_env, report):
    losses, shape = run["losses"], run["shape"]
    report.figure("loss_first", round(losses[0], 4))
    report.figure("loss_last", round(losses[-1], 4))
    report.figure("img_per_s", round(run["mine"]["img_per_s"], 1), "img/s")
    report.figure("img_per_s_total", round(run["verdict"]["img_per_s_total"], 1), "img/s")
    # Per rank, so a fleet's report shows memory flat in the world size.
    report.figure("input_bytes", run["input_bytes"], "B")
    report.figure("peak_rss", round(run["peak_rss"] / (1 << 20)), "MiB")
    report.context("resnet50", {"batch_per_rank": shape.batch, "image_size": shape.image_size,
                                "dtype": str(shape.dtype).removeprefix("torch."), "losses": losses,
                                "bench_steps": run["bench_steps"], "channels_last": dist_env.is_gpu,
                                "cudnn_benchmark": torch.backends.cudnn.benchmark})
    return Judged(judged.loss_wrong(losses, dist_env.gpu_index), hint=judged.LOSS)


def test_gradients_are_identical_across_ranks(run, dist_env, report):
    rank = dist_env.rank
    return Judged([judged.disagrees("gradients", rank, dist_env.gpu_index, f"after backward at step {step}: digest "
                                    f"{run['mine']['grads'][step]}, rank 0 has {reference}")
                   for step, (reference, odd) in enumerate(run["verdict"]["grads"]) if rank in odd][:1],
                  hint=judged.RANKS_DISAGREE)


def test_parameters_are_identical_after_the_step(run, dist_env, report):
    verdict, found = run["verdict"], []
    if dist_env.rank in verdict["params"]:
        mine = training.per_tensor_digests(run["model"].named_parameters())
        first = training.first_difference(mine, verdict["reference_params"])
        found.append(judged.disagrees("parameters", dist_env.rank, dist_env.gpu_index, f"after "
                                      f"{len(run['mine']['grads'])} steps, different first in {first}"))
    return Judged(found, hint=judged.RANKS_DISAGREE)


def test_checkpoint_reloads_identically_on_every_rank(run, dist_env, report):
    report.figure("digest", run["mine"]["checkpoint"])
    return Judged([judged.disagrees("reloaded checkpoint", dist_env.rank, dist_env.gpu_index, "rank 0's checkpoint "
                                    "reloaded into different weights")]
                  if dist_env.rank in run["verdict"]["checkpoint"] else [], hint=judged.RANKS_DISAGREE)


def test_one_step_equals_a_single_process_reference(dist_env, report):
    """Each rank builds its network from its own seed (so DDP's start-up broadcast has work to do) and takes one
    DDP step on its own shard; every rank's parameters must then equal one step of the whole global batch and its
    BatchNorm buffers those of its shard, both computed in float64 on the CPU by formula (no convolution,
    batch_norm or linear kernel shared with the rank, so a kernel wrong on every rank shows), within the float32
    rounding of the step."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    # float32 kernels, no TF32 (convolutions nor the linear head's GEMM): the bound is float32's.
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            model = training.small_net(training.REFERENCE_SEED + rank).to(device)
            ddp = DistributedDataParallel(model, device_ids=[device.index] if dist_env.is_gpu else None)
            start = training.small_net(training.REFERENCE_SEED).state_dict()  # rank 0's, rebuilt here
            unsynced = [name for name, value in model.state_dict().items()
                        if not torch.equal(value.cpu(), start[name])]
            optimizer = torch.optim.SGD(ddp.parameters(), lr=training.REFERENCE_LR)
            images, labels = training.reference_shard(rank, world)
            training.sgd_step(ddp, images.to(device), labels.to(device), optimizer)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    reference = training.reference_step(world)
    eps = torch.finfo(torch.float32).eps
    offs = {f"parameter {name}": training.off(param, reference.params[name], recipe.ddp_step_bound(
        eps, world, training.REFERENCE_LR, reference.params[name], reference.magnitude[name]))
        for name, param in model.named_parameters()}
    offs |= {f"buffer {name}": training.off(buffer, reference.buffers[rank][name], recipe.running_stat_bound(
        eps, reference.buffers[rank][name].double(), reference.buffer_magnitude[rank][name]))
        for name, buffer in model.named_buffers()}
    report.figure("reference", f"{world} shards x {training.REFERENCE_BATCH} images, float64 on the CPU")
    report.figure("worst_error_over_tolerance", round(max((o.ratio for o in offs.values()), default=0.0), 4))
    return Judged(judged.step_off(rank, training.REFERENCE_LR, unsynced, offs, dist_env.gpu_index),
                  hint=judged.STEP_OFF)
