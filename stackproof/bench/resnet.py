"""`stackproof bench resnet`: ResNet-50 training throughput on 1..N GPUs (DDP from 2), eager and torch.compile'd.

Every count of GPUs is a run of this module's worker on that many ranks, started as validate starts its ranks
(stackproof/run/local_ranks.py; synthetic data already on the device, bf16 autocast, channels_last): img/s per
GPU, the total, scaling against one GPU, and torch.compile's compile time.
On a machine without GPUs the same runs use CPU ranks (gloo) and small images, so the path is testable anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from stackproof import files
from stackproof.errors import ConfigError, StackproofError
from stackproof.report import outputs
from stackproof.run import local_ranks
from stackproof.settings import Settings, at_least, option, parse_counts, seconds

MODES = ("eager", "compiled")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class ResnetBench(Settings):
    nproc: tuple[int, ...] = option((1,), "GPU counts to run, e.g. 1,2,8 (CPU ranks without GPUs)", metavar="N,...",
                                    parse=parse_counts)
    compile: bool = option(False, "also run torch.compile'd (reports its compile time)")
    compile_mode: str = option("default", "torch.compile's mode with --compile", choices=COMPILE_MODES)
    batch: int | None = option(None, "images per GPU and step (default 256 on GPU, 8 on CPU)", metavar="N",
                               check=at_least(1))
    image_size: int | None = option(None, "input size (default 224 on GPU, 64 on CPU)", metavar="PX",
                                    check=at_least(1))
    steps: int = option(30, "timed steps", metavar="N", check=at_least(1))
    warmup: int = option(10, "steps before timing (cudnn autotuning, compilation)", metavar="N", check=at_least(1))
    timeout: float = option(900.0, "seconds one run (one GPU count, one mode) may take", metavar="S", check=seconds)
    output: str | None = option(None, "also write the results as JSON here (checked before the benchmark runs)",
                                flag="-o", metavar="FILE",
                                check=outputs.output_problem("benchmark's results", "resnet.json"))

    def __post_init__(self) -> None:
        problems = self.field_problems()
        if any(n < 1 for n in self.nproc):
            problems.append(f"--nproc: expected counts >= 1, found {','.join(map(str, self.nproc))}")
        self.refuse(problems, "stackproof bench resnet --help")

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.compile else MODES[:1]


@dataclasses.dataclass(frozen=True)
class Result:
    gpus: int
    device: str  # "cuda" or "cpu"
    mode: str
    batch: int
    image_size: int
    img_per_s_total: float
    img_per_s_per_gpu: float
    compile_s: float | None
    scaling: float | None = None  # img/s total / (gpus x the 1-GPU run's img/s of the same mode)


def run(settings: ResnetBench, out=sys.stdout) -> int:
    results: list[Result] = []
    print(f"# ResNet-50 training throughput: DDP, synthetic data on the device, {settings.steps} timed steps "
          f"after {settings.warmup} warm-up; modes: {', '.join(settings.modes)}"
          + (f" (torch.compile mode {settings.compile_mode})" if settings.compile else ""), file=out, flush=True)
    for gpus in settings.nproc:
        for mode in settings.modes:
            results.append(_launch(settings, gpus, mode))
            print(f"# ran {gpus} x {results[-1].device} {mode}: {results[-1].img_per_s_total:.1f} img/s",
                  file=out, flush=True)
    results = with_scaling(results)
    print(format_table(results), file=out)
    if settings.output:
        files.write_text(Path(settings.output), json.dumps({
            "schema": "stackproof.bench.resnet/1", "settings": dataclasses.asdict(settings),
            "results": [dataclasses.asdict(r) for r in results]}, indent=2))
        print(f"# results: {settings.output}", file=out)
    return 0


def with_scaling(results: list[Result]) -> list[Result]:
    """Scaling per mode against that mode's one-GPU run (None without one)."""
    single = {r.mode: r.img_per_s_per_gpu for r in results if r.gpus == 1}
    return [dataclasses.replace(r, scaling=r.img_per_s_total / (r.gpus * single[r.mode]) if r.mode in single else None)
            for r in results]


def format_table(results: list[Result]) -> str:
    """nccl-tests' conventions: units in the header, '#' before every line that is not data."""
    lines = [f"# {'gpus':>5}  {'device':>6}  {'mode':>8}  {'batch':>5}  {'img/s/gpu':>10}  {'img/s':>10}  "
             f"{'scaling':>7}  {'compile':>8}",
             f"# {'':>5}  {'':>6}  {'':>8}  {'(/gpu)':>5}  {'(img/s)':>10}  {'(img/s)':>10}  {'':>7}  {'(s)':>8}"]
    for r in results:
        scaling = f"{r.scaling:.3f}" if r.scaling is not None else "-"
        compile_s = f"{r.compile_s:.1f}" if r.compile_s is not None else "-"
        lines.append(f"  {r.gpus:>5}  {r.device:>6}  {r.mode:>8}  {r.batch:>5}  {r.img_per_s_per_gpu:>10.1f}  "
                     f"{r.img_per_s_total:>10.1f}  {scaling:>7}  {compile_s:>8}")
    lines.append("# scaling = img/s / (gpus x the 1-GPU img/s of the same mode)")
    return "\n".join(lines)


def _launch(settings: ResnetBench, gpus: int, mode: str) -> Result:
    """One run of the worker on `gpus` ranks, started the way validate starts its ranks (local_ranks: every rank's
    process group is stopped on a failure or the timeout); rank 0 hands back its result as JSON in a file of ours."""
    with tempfile.TemporaryDirectory(prefix="stackproof-bench-") as tmp:
        result_file = Path(tmp) / "result.json"
        worker_argv = dataclasses.replace(settings, nproc=()).to_argv()
        command = [sys.executable, "-m", "stackproof.bench.resnet", *worker_argv, "--mode", mode,
                   "--result", str(result_file)]
        outcome = local_ranks.run(command, gpus, dict(os.environ), settings.timeout, logs=Path(tmp) / "logs")
        what = f"bench resnet on {gpus} ({mode})"
        if outcome.timed_out:
            raise StackproofError(f"{what}: expected to finish within --timeout {settings.timeout:g} s, found it still "
                                  "running (every rank was stopped); raise --timeout or fewer --steps")
        if outcome.exit_code or not result_file.exists():
            rank = outcome.failures[0]["rank"] if outcome.failures else 0
            log = Path(tmp) / "logs" / f"rank{rank}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
            raise StackproofError(f"{what}: expected every rank to exit 0 with a result, found rank {rank} exit "
                                  f"code {outcome.exit_code}; its last lines:\n{tail}")
        return Result(**json.loads(result_file.read_text()))


def _worker(argv: list[str]) -> None:
    """One rank (RANK, WORLD_SIZE, ... from local_ranks): train, time, and on rank 0 write the run's result."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    from stackproof.bench.rank import start
    from stackproof.measure import training

    me = start(ResnetBench, MODES, argv)
    settings, rank, world, on_gpu, device = me.settings, me.rank, me.world, me.on_gpu, me.device
    shape = training.TrainShape.for_device(on_gpu, settings.batch or (None if on_gpu else 8), settings.image_size)

    memory_format = torch.channels_last if on_gpu else torch.contiguous_format
    model = torchvision.models.resnet50(num_classes=training.NUM_CLASSES).to(device, memory_format=memory_format)
    # One GPU trains the model as a single-GPU user would; more use DDP (buckets as gradient views: no copy).
    # Measured on one H200: plain 4701-4715 img/s, under DDP 4583 (4629 with bucket views).
    parallel = model if world == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if on_gpu else None, gradient_as_bucket_view=True)
    trained = torch.compile(parallel, mode=settings.compile_mode) if me.mode == "compiled" else parallel
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=on_gpu or None)
    images, labels = training.SyntheticImages(shape.batch, shape.image_size).batch(range(shape.batch))
    images, labels = images.to(device, memory_format=memory_format), labels.to(device)
    _, step = training.train_step(trained, optimizer, images, labels, shape.dtype if on_gpu else None)

    begin = time.perf_counter()
    step()
    if on_gpu:
        torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - begin  # compilation happens here
    for _ in range(settings.warmup - 1):
        step()
    mine = training.images_per_second(step, shape.batch, settings.steps, device)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        total = float(sum(everyone))
        Path(me.result).write_text(json.dumps(dataclasses.asdict(Result(
            gpus=world, device=device.type, mode=me.mode, batch=shape.batch, image_size=shape.image_size,
            img_per_s_total=total, img_per_s_per_gpu=total / world,
            compile_s=first_step_s if me.mode == "compiled" else None))))
    dist.barrier()
    os._exit(0)  # skip the NCCL/CUDA teardown: the result is written


if __name__ == "__main__":
    try:
        _worker(sys.argv[1:])
    except ConfigError as err:
        print(f"stackproof bench resnet: {err}", file=sys.stderr)
        sys.exit(int(err.exit_code))
