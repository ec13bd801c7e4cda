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
from stackproof.suite.report import EXIT_CODES, EXIT_INCOMPLETE, EXIT_OK
from stackproof.suite.visibility import no_gpu_verdict

KILL_GRACE_S = 10


def _torchrun(settings: ValidateConfig, nproc: int) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=1", "-m", "stackproof.suite.worker"]
    env = {**os.environ, CONFIG_ENV: settings.to_env(), worker.LAUNCHED_ENV: "1"}
    # On a NCCL timeout, abort the communicator but keep the process: PyTorch's default kills the waiting rank
    # first, before stackproof's watchdog (watchdog.py) can say which rank stalled it (seen on H200s).
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    # Share the cores between ranks (torchrun would pin each to one thread, with a warning).
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
    no_gpu = no_gpu_verdict(settings, visible)
    if no_gpu is not None:
        return no_gpu
    report_path = Path(settings.reports) / "report.json"
    report_path.unlink(missing_ok=True)
    # One rank per visible GPU; a shortfall against --expect-gpus is the visibility check's to report.
    rc = _torchrun(settings, visible or settings.cpu_procs)
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
