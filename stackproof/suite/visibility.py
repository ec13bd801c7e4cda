"""How many GPUs a node must see, and the verdict when it sees fewer: one decision for the launcher, every rank
started by torchrun, srun or Kubernetes directly, and the scripts (`stackproof local-ranks`), so that a rank
without its GPU never passes on CPU by accident."""

from __future__ import annotations

import os
from typing import IO

from stackproof.errors import Exit
from stackproof.suite.config import ValidateConfig
from stackproof.suite.report import Report

NO_GPU_VALUES = ("", "void", "none")


def expected_gpus(flag: int | None, env: dict[str, str] | os._Environ) -> tuple[int, str]:
    """(how many GPUs this node must show, why). 0 means the run may use the CPU.

    --expect-gpus wins; then the GPUs Slurm allocated on this node; then a container started for GPUs
    (NVIDIA_VISIBLE_DEVICES set to devices, as stackproof's images and NVIDIA's container toolkit do) expects
    at least one."""
    if flag is not None:
        return flag, f"--expect-gpus {flag}"
    slurm = env.get("SLURM_GPUS_ON_NODE")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        return int(slurm), f"SLURM_GPUS_ON_NODE={slurm} (the job's GPUs on this node)"
    requested = env.get("NVIDIA_VISIBLE_DEVICES")
    if requested is None or requested.strip().lower() in NO_GPU_VALUES:
        return 0, "no GPU requested (NVIDIA_VISIBLE_DEVICES unset or void)"
    return 1, f"NVIDIA_VISIBLE_DEVICES={requested}"


def no_gpu_verdict(settings: ValidateConfig, visible: int, out: IO[str], write_report: bool = True) -> Exit | None:
    """Exit.NO_GPU, after saying so (and writing report.json), when GPUs are expected and none is visible (fewer
    than expected, but some, is the GPU check's failure: it names them)."""
    expected, why = expected_gpus(settings.expect_gpus, os.environ)
    if not expected or visible:
        return None
    message = (f"no GPU visible, but GPUs were expected ({why}): expected >= {expected}, found {visible}; "
               "fix: give the container its GPUs (docker run --gpus all, or --device nvidia.com/gpu=all with CDI; "
               "Kubernetes: an nvidia.com/gpu limit; "
               "Slurm: check gres.conf), or validate on CPU on purpose with --expect-gpus 0 "
               "(or -e NVIDIA_VISIBLE_DEVICES=void)")
    lines = [f"# stackproof validate: {message}"]
    if write_report:
        report = Report(override=(Exit.NO_GPU, message))
        report.context.update(expected_gpus=expected, visible_gpus=visible, reason=why)
        lines.append(f"# report: {report.write(settings.reports_dir)}")
    lines.append(f"# Verdict: {Exit.NO_GPU.verdict} (exit code {int(Exit.NO_GPU)}: {Exit.NO_GPU.meaning})")
    print("\n".join(lines), file=out, flush=True)
    return Exit.NO_GPU
