"""`stackproof bench parallel`: the same model (ResNet-50, synthetic data on the device, bf16 autocast) trained
under DataParallel (one process: the batch split over every visible GPU, replicas made each step, outputs and
gradients gathered on GPU 0) and under DDP (one process per GPU): img/s, each GPU's peak memory (DataParallel's
GPU-0 excess), and the step's time split into forward, backward and optimizer.

Both run on however many GPUs are visible; a comparison needs 2 or more (on one, DataParallel is the plain
module). Without GPUs, DataParallel runs the module in one CPU process and DDP on --cpu-ranks CPU ranks (gloo);
memory is each process's peak resident size there, not a GPU's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from stackproof import files
from stackproof.errors import ConfigError, StackproofError
from stackproof.report import outputs
from stackproof.run import local_ranks
from stackproof.settings import Settings, at_least, option, seconds

MODES = ("dp", "ddp")
MODE_NAMES = {"dp": "DataParallel", "ddp": "DDP"}
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ParallelBench(Settings):
    batch: int | None = option(None, "images per GPU and step, 2 or more for BatchNorm (default 128 on GPU, 4 on "
                                     "CPU); DataParallel's step takes this times the GPUs", metavar="N",
                               check=at_least(2))
    image_size: int | None = option(None, "input size (default 224 on GPU, 32 on CPU)", metavar="PX",
                                    check=at_least(1))
    steps: int = option(20, "timed steps", metavar="N", check=at_least(1))
    warmup: int = option(5, "steps before timing (cudnn autotuning)", metavar="N", check=at_least(1))
    cpu_ranks: int = option(2, "DDP's ranks without GPUs", metavar="N", check=at_least(1))
    timeout: float = option(900.0, "seconds one run (one mode) may take", metavar="S", check=seconds)
    output: str | None = option(None, "also write the results as JSON here (checked before the benchmark runs)",
                                flag="-o", metavar="FILE",
                                check=outputs.output_problem("benchmark's results", "parallel.json"))
    plot: str | None = option(None, "also draw img/s and each GPU's peak memory per mode here (SVG)",
                              metavar="FILE", check=outputs.output_problem("benchmark's plot", "parallel.svg"))

    def __post_init__(self) -> None:
        self.refuse(self.field_problems(), "stackproof bench parallel --help")


@dataclasses.dataclass(frozen=True)
class Result:
    mode: str  # dp or ddp
    device: str  # cuda or cpu
    gpus: int  # GPUs used (CPU processes for DDP without GPUs)
    batch: int  # images per step in all
    image_size: int
    img_per_s: float
    peak_mib: list[float]  # per GPU (GPU memory), or per process without GPUs (resident size)
    forward_ms: float
    backward_ms: float
    optimizer_ms: float


def note(results: list[Result]) -> str:
    """What the comparison can say on this machine."""
    if not results or results[0].device != "cuda":
        return ("no GPU: DataParallel ran the module in one CPU process and DDP on CPU ranks (gloo); peak memory is "
                "each process's resident size; a DataParallel/DDP comparison needs 2+ GPUs")
    if results[0].gpus < 2:
        return ("one GPU: DataParallel is the plain module and DDP one rank; a comparison needs 2+ GPUs "
                "(CUDA_VISIBLE_DEVICES)")
    dp, ddp = ({r.mode: r for r in results}.get(m) for m in MODES)
    if not (dp and ddp):
        return ""
    excess = dp.peak_mib[0] - max(dp.peak_mib[1:], default=dp.peak_mib[0])
    return (f"DDP / DataParallel img/s: {ddp.img_per_s / dp.img_per_s:.2f}x; DataParallel's GPU 0 holds "
            f"{excess:.0f} MiB more than its other GPUs' peak")


def format_table(results: list[Result]) -> str:
    """nccl-tests' conventions: units in the header, '#' before every line that is not data."""
    lines = [f"# {'mode':>12}  {'device':>6}  {'gpus':>4}  {'batch':>5}  {'img/s':>9}  {'forward':>8}  "
             f"{'backward':>8}  {'optim':>7}  peak memory per GPU",
             f"# {'':>12}  {'':>6}  {'':>4}  {'(all)':>5}  {'(img/s)':>9}  {'(ms)':>8}  {'(ms)':>8}  {'(ms)':>7}  "
             "(MiB)"]
    for r in results:
        lines.append(f"  {MODE_NAMES[r.mode]:>12}  {r.device:>6}  {r.gpus:>4}  {r.batch:>5}  {r.img_per_s:>9.1f}  "
                     f"{r.forward_ms:>8.1f}  {r.backward_ms:>8.1f}  {r.optimizer_ms:>7.1f}  "
                     + ",".join(f"{m:.0f}" for m in r.peak_mib))
    if said := note(results):
        lines.append(f"# {said}")
    return "\n".join(lines)


def draw(results: list[Result]) -> str:
    """Two panels as SVG: img/s per mode, and each GPU's (process's) peak memory per mode."""
    from stackproof.report import plots

    plt = plots.plt
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(8, 3))
    names = [MODE_NAMES[r.mode] for r in results]
    speed.bar(names, [r.img_per_s for r in results], color="tab:blue")
    speed.set_ylabel("img/s (higher is better)")
    speed.set_title("throughput", fontsize=9)
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        memory.bar([g + i * width for g in range(len(r.peak_mib))], r.peak_mib, width, label=names[i])
    memory.set_xlabel("GPU" if results and results[0].device == "cuda" else "process")
    memory.set_ylabel("peak MiB")
    memory.set_title("peak memory", fontsize=9)
    memory.legend(fontsize=7)
    return plots._svg(fig)


def run(settings: ParallelBench, out=sys.stdout) -> int:
    import torch  # here: the CLI's other commands do not pay for it

    gpus = torch.cuda.device_count()
    where = f"{gpus} GPU(s)" if gpus else f"the CPU ({settings.cpu_ranks} DDP ranks)"
    print(f"# DataParallel beside DDP: ResNet-50, synthetic data on the device, {settings.steps} timed steps after "
          f"{settings.warmup} warm-up, on {where}", file=out, flush=True)
    results = []
    for mode in MODES:
        results.append(_launch(settings, mode, 1 if mode == "dp" else gpus or settings.cpu_ranks))
        print(f"# ran {MODE_NAMES[mode]}: {results[-1].img_per_s:.1f} img/s", file=out, flush=True)
    print(format_table(results), file=out)
    if settings.output:
        files.write_text(Path(settings.output), json.dumps({
            "schema": "stackproof.bench.parallel/1", "settings": dataclasses.asdict(settings),
            "results": [dataclasses.asdict(r) for r in results], "note": note(results)}, indent=2))
        print(f"# results: {settings.output}", file=out)
    if settings.plot:
        files.write_text(Path(settings.plot), draw(results))
        print(f"# plot: {settings.plot}", file=out)
    return 0


def _launch(settings: ParallelBench, mode: str, ranks: int) -> Result:
    """One run of the worker: DataParallel as one process that sees every GPU, DDP as one rank per GPU, started
    the way validate starts its ranks (every rank stopped on a failure or the timeout)."""
    with tempfile.TemporaryDirectory(prefix="stackproof-bench-") as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "stackproof.bench.parallel", *settings.to_argv(), "--mode", mode,
                   "--result", str(result_file)]
        outcome = local_ranks.run(command, ranks, dict(os.environ), settings.timeout, logs=Path(tmp) / "logs")
        what = f"bench parallel, {MODE_NAMES[mode]} on {ranks} process(es)"
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


def _timed_split(model, optimizer, images, labels, autocast, sync, steps: int) -> tuple[float, float, float]:
    """Mean milliseconds of forward, backward and the optimizer over `steps` steps, the device synchronized
    between them (the split; img/s is timed without these synchronizations)."""
    import torch

    spent = [0.0, 0.0, 0.0]
    for _ in range(steps):
        marks = [time.perf_counter()]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(images.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        optimizer.step()
        sync()
        marks.append(time.perf_counter())
        for i in range(3):
            spent[i] += marks[i + 1] - marks[i]
    return tuple(1000 * s / steps for s in spent)


def _worker(argv: list[str]) -> None:
    """One process: DataParallel over every visible GPU (world 1), or one DDP rank; rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    from stackproof.bench.rank import start
    from stackproof.measure import training

    me = start(ParallelBench, MODES, argv, alone=("dp",))  # DataParallel: one process, no group
    settings, rank, world, on_gpu, device = me.settings, me.rank, me.world, me.on_gpu, me.device
    shape = training.TrainShape.for_device(on_gpu, settings.batch or (128 if on_gpu else 4),
                                           settings.image_size or (None if on_gpu else 32))
    gpus = torch.cuda.device_count() if me.mode == "dp" and on_gpu else world
    memory_format = torch.channels_last if on_gpu else torch.contiguous_format
    model = torchvision.models.resnet50(num_classes=training.NUM_CLASSES).to(device, memory_format=memory_format)
    if me.mode == "dp":
        parallel, batch = DataParallel(model), shape.batch * (gpus if on_gpu else 1)
    else:
        parallel, batch = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None), shape.batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = training.SyntheticImages(batch, shape.image_size).batch(range(batch))
    images, labels = images.to(device, memory_format=memory_format), labels.to(device)
    autocast = shape.dtype if on_gpu else None
    _, step = training.train_step(parallel, optimizer, images, labels, autocast)
    for _ in range(settings.warmup):
        step()
    img_per_s = training.images_per_second(step, batch, settings.steps, device)

    def sync():
        if on_gpu:
            for index in range(gpus if me.mode == "dp" else 1):
                torch.cuda.synchronize(index if me.mode == "dp" else device)
    split = _timed_split(parallel, optimizer, images, labels, autocast, sync, max(1, settings.steps // 2))
    if on_gpu:
        indices = range(gpus) if me.mode == "dp" else [device.index]
        peaks = [torch.cuda.max_memory_allocated(i) / MiB for i in indices]
    else:
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]  # KiB on Linux
    mine = {"img_per_s": img_per_s, "peaks": peaks, "split": split}
    everyone = [mine]
    if me.mode == "ddp":
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(me.result).write_text(json.dumps(dataclasses.asdict(Result(
            mode=me.mode, device=device.type, gpus=gpus, batch=batch * (world if me.mode == "ddp" else 1),
            image_size=shape.image_size, img_per_s=float(sum(e["img_per_s"] for e in everyone)),
            peak_mib=[round(p, 1) for e in everyone for p in e["peaks"]],
            forward_ms=max(e["split"][0] for e in everyone), backward_ms=max(e["split"][1] for e in everyone),
            optimizer_ms=max(e["split"][2] for e in everyone)))))
    if me.mode == "ddp":
        dist.barrier()
    os._exit(0)  # skip the NCCL/CUDA teardown: the result is written


if __name__ == "__main__":
    try:
        _worker(sys.argv[1:])
    except ConfigError as err:
        print(f"stackproof bench parallel: {err}", file=sys.stderr)
        sys.exit(int(err.exit_code))
