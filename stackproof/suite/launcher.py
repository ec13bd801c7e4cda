"""`stackproof validate`: check the input, decide how many ranks, start them through torchrun (agent.py), and
settle what they did into one verdict and exit code (verdict.py). Under torchrun or srun it is itself one rank
and runs the suite directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from stackproof.errors import ConfigError
from stackproof.suite import pins, topology, verdict
from stackproof.suite.config import ValidateConfig
from stackproof.suite.dist import launched_by_a_launcher
from stackproof.suite.visibility import no_gpu_verdict

KILL_GRACE_S = 10


def check_input(settings: ValidateConfig) -> None:
    """Bad input ends the run here, with exit 2, before any rank starts."""
    if os.environ.get("PYTEST_ADDOPTS"):
        raise ConfigError(f"PYTEST_ADDOPTS={os.environ['PYTEST_ADDOPTS']!r} is set: the suite runs its own pytest; "
                          "fix: unset it, and pass pytest options after -- (stackproof validate -- -x)")
    # A missing/invalid file or image: exit 2.
    pins.expected(settings.expect_file, settings.image, os.environ, settings.expect_declared)


def validate(settings: ValidateConfig) -> int:
    check_input(settings)
    from stackproof.suite import worker  # imports torch: after the checks above, which take no time

    if launched_by_a_launcher():
        return worker.run(settings)
    visible = topology.visible_count()
    if visible is None:  # no NVML here: ask CUDA itself
        import torch

        visible = torch.cuda.device_count()
    no_gpu = no_gpu_verdict(settings, visible, sys.stdout)
    if no_gpu is not None:
        return no_gpu
    nproc = visible or settings.nproc  # one rank per visible GPU
    settings.check_world(nproc * settings.nnodes)
    held = verdict.prepare(settings.reports_dir, settings.nnodes)  # the folder is this run's until it is settled
    try:
        print(f"# stackproof validate: {nproc} rank(s) on this node "
              f"({'NCCL, one per GPU' if visible else 'gloo, CPU'}) of {settings.nnodes} node(s), tier "
              f"{settings.tier}; reports: {settings.reports}", flush=True)
        rc, interrupted, timed_out = _torchrun(settings, nproc)
        return verdict.conclude(settings.reports_dir, sys.stdout, launcher_exit=rc, interrupted=interrupted,
                                timed_out_s=settings.run_timeout if timed_out else None)
    finally:
        held.release()


def _torchrun(settings: ValidateConfig, nproc: int) -> tuple[int, str | None, bool]:
    """(torchrun's exit code, the signal that interrupted the run if any, whether --run-timeout stopped it)."""
    cmd = [sys.executable, "-m", "stackproof.suite.agent", settings.reports, *settings.torchrun_rendezvous(),
           f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=1",
           "-m", "--", "stackproof", "validate", *settings.to_argv()]
    from stackproof.suite.worker import LAUNCHED_ENV

    env = {**os.environ, LAUNCHED_ENV: "1"}
    # Share the cores between ranks (torchrun would pin each to one thread, with a warning).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    interrupted: list[str] = []

    def stop(signum: int, _frame: object) -> None:
        # Ctrl-C / docker stop: stop every rank, not only torchrun, and say so in the verdict.
        interrupted.append(signal.Signals(signum).name)
        _kill(proc, signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait(timeout=settings.run_timeout)
        return rc, (interrupted[0] if interrupted else None), False
    except subprocess.TimeoutExpired:
        _kill(proc, signal.SIGTERM)
        return -1, None, True
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
