"""How many GPUs a run must see, and the verdict when it sees none: the same decision in the launcher and in
every rank started by torchrun or srun directly (a rank without a GPU must not pass on CPU by accident)."""

from __future__ import annotations

import os

from stackproof.suite.config import ValidateConfig
from stackproof.suite.report import EXIT_CODES, EXIT_NO_GPU, Report

NO_GPU_VALUES = ("", "void", "none")


def expected_gpus(flag: int | None, env: dict[str, str] | os._Environ) -> tuple[int, str]:
    """(how many GPUs must be visible, why). 0 means the run may use the CPU.

    --expect-gpus wins; otherwise a container started for GPUs (NVIDIA_VISIBLE_DEVICES set to devices, as
    stackproof's images and NVIDIA's container toolkit do) expects at least one."""
    if flag is not None:
        return flag, f"--expect-gpus {flag}"
    requested = env.get("NVIDIA_VISIBLE_DEVICES")
    if requested is None or requested.strip().lower() in NO_GPU_VALUES:
        return 0, "no GPU requested (NVIDIA_VISIBLE_DEVICES unset or void)"
    return 1, f"NVIDIA_VISIBLE_DEVICES={requested}"


def no_gpu_verdict(settings: ValidateConfig, visible: int, write_report: bool = True) -> int | None:
    """EXIT_NO_GPU, after saying so (and writing report.json), when GPUs are expected and none is visible."""
    expected, why = expected_gpus(settings.expect_gpus, os.environ)
    if not expected or visible:
        return None
    message = (f"no GPU visible, but GPUs were expected ({why}): expected >= {expected}, found {visible}; "
               "fix: give the container GPUs (docker run --gpus all, or GPU_FLAGS= for make test-gpu), "
               "or validate on CPU on purpose with --expect-gpus 0 (or -e NVIDIA_VISIBLE_DEVICES=void)")
    lines = [f"# stackproof validate: {message}"]
    if write_report:
        report = Report(verdict_override=(EXIT_NO_GPU, message))
        report.context.update(expected_gpus=expected, visible_gpus=visible, reason=why)
        lines.append(f"# report: {report.write(settings.reports_dir)}")
    lines.append(f"# Verdict: FAILED (exit code {EXIT_NO_GPU}: {EXIT_CODES[EXIT_NO_GPU]})")
    print("\n".join(lines), flush=True)
    return EXIT_NO_GPU
