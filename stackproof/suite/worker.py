"""One rank of a validation run: pytest over smoke_tests/ with the stackproof plugin.

Started by torchrun (from the launcher, or by you), by srun, or directly for a world of one.
Rank 0 talks to the terminal; every other rank writes to reports/logs/rank<N>.log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stackproof.suite.config import CONFIG_ENV, ValidateConfig
from stackproof.suite.dist import adopt_slurm_env
from stackproof.suite.visibility import no_gpu_verdict

LAUNCHED_ENV = "STACKPROOF_LAUNCHED"
SMOKE_TESTS = Path(__file__).resolve().parents[2] / "smoke_tests"


def _redirect_output(log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _nccl_debug_to_file(reports: Path) -> None:
    """NCCL says which transport it chose only at INFO level: send that to a file the bandwidth check reads."""
    if "NCCL_DEBUG" in os.environ:
        return
    (reports / "nccl").mkdir(parents=True, exist_ok=True)
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_FILE"] = str((reports / "nccl" / "nccl.%h.%p.log").resolve())


def run(settings: ValidateConfig) -> int:
    adopt_slurm_env(os.environ)  # type: ignore[arg-type]
    # The plugin reads the settings from the environment: under srun/torchrun (no launcher in between) they
    # come from this rank's own command line, so hand them on, or --reports, --timeout, --inject-fault... are lost.
    os.environ[CONFIG_ENV] = settings.to_env()
    rank = int(os.environ.get("RANK", "0"))
    reports = settings.reports_dir
    if not os.environ.get(LAUNCHED_ENV):  # the launcher has decided this already
        import torch

        no_gpu = no_gpu_verdict(settings, torch.cuda.device_count(), write_report=rank == 0)
        if no_gpu is not None:
            return no_gpu
    _nccl_debug_to_file(reports)
    args = [str(SMOKE_TESTS), "-p", "no:cacheprovider", "-q",
            "--rootdir", str(SMOKE_TESTS), *settings.pytest_args]
    if rank == 0:
        args += ["--junitxml", str(reports / "junit.xml"), "-o", "junit_suite_name=stackproof"]
    else:
        _redirect_output(reports / "logs" / f"rank{rank}.log")
    rc = pytest.main(args)
    if os.environ.get(LAUNCHED_ENV) and rc in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        # The verdict travels in report.json; a non-zero exit here would read as a crashed rank to torchrun.
        return 0
    return rc


def main() -> int:
    return run(ValidateConfig.from_env())


if __name__ == "__main__":
    sys.exit(main())
