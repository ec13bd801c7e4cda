"""One benchmark process as local_ranks starts it (bench/parallel.py, bench/resnet.py): its settings from its
command line, its place in the world from the launcher's RANK, WORLD_SIZE and LOCAL_RANK (read through
stackproof/environment.py), its device, and the process group when it joins one."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from stackproof import environment
from stackproof.settings import Settings


@dataclasses.dataclass(frozen=True)
class BenchRank:
    settings: Any  # the bench's Settings
    mode: str
    result: str  # where rank 0 writes the run's result
    rank: int
    world: int
    device: Any  # torch.device
    on_gpu: bool


def start(bench: type[Settings], modes: Sequence[str], argv: list[str], alone: Sequence[str] = ()) -> BenchRank:
    """Parse the rank's command line (the bench's flags, --mode, --result), take its device (cuDNN autotuned on a
    GPU) and, unless its --mode is one of `alone`, create the default process group within --timeout (NCCL on
    GPUs, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--mode", choices=modes, required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    settings = bench.from_args(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                     if k not in ("mode", "result")}))
    rank, world = int(environment.RANK.get()), int(environment.WORLD_SIZE.get())
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(environment.LOCAL_RANK.get())) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if args.mode not in alone:
        dist.init_process_group("nccl" if on_gpu else "gloo",
                                timeout=datetime.timedelta(seconds=settings.timeout),  # type: ignore[attr-defined]
                                device_id=device if on_gpu else None)
    return BenchRank(settings, args.mode, args.result, rank, world, device, on_gpu)
