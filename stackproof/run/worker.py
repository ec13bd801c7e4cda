"""One rank of a validation run: pytest over the suite (smoke_tests/) with the stackproof plugin.

Started by torchrun (from the launcher, scripts/torchrun, or by you), by srun, or directly for a world of one.
Every rank's pytest output goes to <reports>/logs/rank<N>.log; rank 0's stdout carries only the contract
(the sweep table, the check table, the verdict).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import pytest

from stackproof import environment, pipes
from stackproof.errors import ConfigError, Exit
from stackproof.report.record import Report, ReportUnreadable
from stackproof.run import launch_env, local_ranks, phases, readings, settle, smoke_tests_dir, watchdog
from stackproof.run.config import ValidateConfig
from stackproof.run.dist import world_size_from_env
from stackproof.run.plugin import Handover
from stackproof.run.visibility import no_gpu_verdict

phases.mark("torch_imported")  # with pytest and the plugin: what every rank loads before its first check
__all__ = ["run"]


@contextlib.contextmanager
def _logged_to(path: Path) -> Iterator[IO[str]]:
    """Point this process's stdout and stderr at its log meanwhile; yield a stream on the terminal's stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # may belong to another uid (a host run before a container run)
    saved = os.dup(1), os.dup(2)
    contract = pipes.reader_may_leave(os.fdopen(os.dup(1), "w", buffering=1))  # `validate | head -1`
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o664)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield contract
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, source in zip((1, 2), saved, strict=True):
            os.dup2(source, target)
            os.close(source)
        contract.close()


def _nccl_debug_to_file(reports, env: Mapping[str, str]) -> str | None:
    """NCCL says which transport it chose only at INFO level: send that to a file, whose pattern (NCCL's %h, %p)
    the bandwidth check is handed; where the caller set NCCL_DEBUG, NCCL's log is theirs (its file, if any)."""
    if environment.NCCL_DEBUG.name in env:
        return environment.NCCL_DEBUG_FILE.get(env) or None
    (reports / "nccl").mkdir(parents=True, exist_ok=True)
    pattern = str((reports / "nccl" / "nccl.%h.%p.log").resolve())
    environment.export({environment.NCCL_DEBUG.name: "INFO", environment.NCCL_DEBUG_FILE.name: pattern})
    return pattern


_held: list[settle.Claim] = []
# pytest's switch for the plugins installed beside it (their entry points): off in a rank.
PLUGIN_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"


def run(settings: ValidateConfig, env: Mapping[str, str]) -> int:
    """Run this rank (`env`: what its launcher told it, Slurm's variables adopted as torch's), then leave at
    once: the verdict is written and every rank has read it (the plugin's last agreement, through the store), so
    nothing of the proof is left to lose. No process-group teardown: no
    collective is outstanding and no peer waits on this rank, and NCCL's destroy (a flush, then the
    communicators' and their threads' end; bounded to 1 s of the 1.3 s the exit took on an H200 at e3b2c64) frees
    only what the exit frees anyway; nor the interpreter's own exit (torch's objects, atexit, finalizers). The
    launcher is told the rank leaves (with its exit code) and bounds what the kernel's and the driver's teardown
    of the process still take."""
    local_ranks.take_leaving_fd()  # before any check: no process the rank starts sees it
    code = _run(settings, env)
    sys.stdout.flush()
    sys.stderr.flush()
    local_ranks.leaving(int(environment.RANK.get(env) or 0), int(code))
    os._exit(int(code))


def _run(settings: ValidateConfig, env: Mapping[str, str]) -> int:
    told = launch_env.told(env)  # checked with the settings (ValidateConfig.from_args)
    launched = told.settles
    rank = int(environment.RANK.get(env) or 0)
    reports = settings.reports_dir
    # NVML's start (0.24 s on an H200) and the inventory, beside torch's import rather than after it: torch's own
    # count of the GPUs below then finds NVML started.
    early = readings.Early(settings.pci_devices)
    import torch

    no_gpu = no_gpu_verdict(settings, torch.cuda.device_count(), sys.stdout, write_report=rank == 0)
    if no_gpu is not None:
        return no_gpu
    settings.check_world(world_size_from_env(env))
    if rank == 0 and not launched:  # started by torchrun or srun directly: nobody prepared the folder
        _held.append(settle.prepare(reports))  # held until this process ends
    nccl_log = _nccl_debug_to_file(reports, env)
    log = reports / "logs" / f"rank{rank}.log"
    suite = smoke_tests_dir()
    # no:unraisableexception: at exit it runs gc.collect() until nothing is left, 0.75 s over torch's objects.
    # no:faulthandler: pytest's would point a crash's stacks at its captured stderr, not at the log (watchdog.py).
    # Only the suite's own plugins: one installed beside it (hypothesis, anyio, xdist, pytest-benchmark in an ML
    # image) loads at every rank's start and may run at its end (1-2 s on the H200's Python); `-- -p NAME` loads one.
    environment.export({PLUGIN_AUTOLOAD: "1"})
    args = [str(suite), "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-p", "no:faulthandler", "-q",
            "--rootdir", str(suite),
            "-c", str(suite / "pytest.ini"),
            *(("-k", settings.select) if settings.select else ()), *settings.pytest_args]
    handover = Handover(settings, None, told, nccl_log, early)
    with _logged_to(log) as contract:
        handover.stdout = contract
        watchdog.send_stacks_to(os.fdopen(os.dup(2), "w", buffering=1))  # the log, past pytest's capture
        rc = pytest.main(args, plugins=[handover])
    if rc == pytest.ExitCode.USAGE_ERROR:
        raise ConfigError(f"pytest rejected its arguments {settings.pytest_args} (its words are in {log}); "
                          "fix: pass only valid pytest options after --")
    if rc == pytest.ExitCode.NO_TESTS_COLLECTED:
        try:  # read only here: the full tier's record takes a while to parse, on every rank 0's way out
            report = Report.load(reports) if rank == 0 else None
        except ReportUnreadable:  # the launcher keeps it and says why; here it only words a message
            report = None
        raise ConfigError(report.message if report and report.override else
                          f"no check was selected (see {log})")
    if rc == pytest.ExitCode.INTERRUPTED:
        return Exit.INTERRUPTED
    if rc == pytest.ExitCode.INTERNAL_ERROR:
        print(f"# stackproof validate: rank {rank}'s pytest failed internally; its traceback is in {log}",
              flush=True)
        return Exit.INCOMPLETE
    if launched:
        return Exit.OK  # the checks ran: the verdict travels in report.json
    return Exit(handover.verdict if handover.verdict is not None else Exit.INCOMPLETE)
