"""`stackproof validate`: decide how many ranks, start them with torchrun, and turn what they did into an
exit code. Under torchrun or srun it is itself one rank and runs the suite directly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from stackproof.suite import worker
from stackproof.suite.config import CONFIG_ENV, ValidateConfig
from stackproof.suite.dist import launched_by_a_launcher
from stackproof.suite.report import EXIT_CODES, EXIT_INCOMPLETE, EXIT_NO_GPU, EXIT_OK, Report

NO_GPU_VALUES = ("", "void", "none")
KILL_GRACE_S = 10


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


def _no_gpu(settings: ValidateConfig, expected: int, why: str, visible: int) -> int:
    message = (f"no GPU visible, but GPUs were expected ({why}): expected >= {expected}, found {visible}; "
               "fix: give the container GPUs (docker run --gpus all, or GPU_FLAGS= for make test-gpu), "
               "or validate on CPU on purpose with --expect-gpus 0 (or -e NVIDIA_VISIBLE_DEVICES=void)")
    report = Report(verdict_override=(EXIT_NO_GPU, message))
    report.context.update(expected_gpus=expected, visible_gpus=visible, reason=why)
    path = report.write(settings.reports_dir)
    print(f"# stackproof validate: {message}\n# report: {path}\n"
          f"# Verdict: FAILED (exit code {EXIT_NO_GPU}: {EXIT_CODES[EXIT_NO_GPU]})", flush=True)
    return EXIT_NO_GPU


def _torchrun(settings: ValidateConfig, nproc: int, on_cpu: bool) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=1", "-m", "stackproof.suite.worker"]
    env = {**os.environ, CONFIG_ENV: settings.to_env(), worker.LAUNCHED_ENV: "1"}
    if on_cpu:  # torchrun would pin every rank to one thread; share the cores instead
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def stop(signum: int, _frame: object) -> None:
        # Ctrl-C / docker stop: stop every rank, not only torchrun.
        _kill(proc, signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(timeout=settings.run_timeout_s)
    except subprocess.TimeoutExpired:
        print(f"# stackproof validate: the run exceeded --run-timeout {settings.run_timeout_s:.0f} s; "
              "stopping every rank (rank logs: reports/logs/)", flush=True)
        _kill(proc, signal.SIGTERM)
        return -1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def validate(settings: ValidateConfig) -> int:
    if launched_by_a_launcher():
        return worker.run(settings)
    import torch  # after the flag checks: importing torch takes seconds

    visible = torch.cuda.device_count()
    expected, why = expected_gpus(settings.expect_gpus, os.environ)
    if expected and not visible:
        return _no_gpu(settings, expected, why, visible)
    report_path = Path(settings.reports) / "report.json"
    report_path.unlink(missing_ok=True)
    # One rank per visible GPU; a shortfall against --expect-gpus is the visibility check's to report.
    rc = _torchrun(settings, visible or settings.cpu_procs, on_cpu=not visible)
    try:
        written = json.loads(report_path.read_text())["exit_code"]
    except (OSError, ValueError, KeyError):
        written = None
    if rc == 0 and written == EXIT_OK:
        return EXIT_OK
    if written not in (None, EXIT_OK):
        return written
    print(f"# stackproof validate: the run did not complete (torchrun exit {rc}): a rank died or was stopped; "
          f"torchrun's summary above names it, rank logs are in {settings.reports}/logs/\n"
          f"# Verdict: FAILED (exit code {EXIT_INCOMPLETE}: {EXIT_CODES[EXIT_INCOMPLETE]})", flush=True)
    return EXIT_INCOMPLETE
