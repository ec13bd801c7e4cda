"""A reader that leaves early (`stackproof ... | head -1`) changes neither a command's exit code nor what it did:
no BrokenPipeError traceback, for every command (issue 36 item 6). The reader is a real pipe whose read end is
closed before the command writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.act.contract import BROKEN_FILE, BROKEN_METRIC
from stackproof.report.record import Check, Report

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
RUN_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STACKPROOF_", "SLURM_", "PYTEST_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _reader_gone(*args: str) -> subprocess.CompletedProcess:
    """`python -m stackproof ARGS` with stdout a pipe nobody reads any more."""
    proc = subprocess.Popen([PYTHON, "-m", "stackproof", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO)
    proc.stdout.close()
    err = proc.stderr.read()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=RUN_TIMEOUT_S), "", err)


def _read(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "stackproof", *args], capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=RUN_TIMEOUT_S)


@pytest.fixture
def passed_run(tmp_path) -> Path:
    ranks = [{"rank": 0, "node": "n1", "host": "n1", "gpu": None}]
    Report(ranks=ranks, checks=[Check("smoke_tests/test_01_identity.py::test_x", "passed")], complete=True,
           started=time.time()).write(tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("command", [["verdict", "--reports", "{run}"], ["images", "list"], ["--help"],
                                     ["spec", "--help"]])
def test_a_closed_stdout_keeps_the_exit_code_of_a_quick_command(command, passed_run):
    args = [a.format(run=passed_run) for a in command]
    read, gone = _read(*args), _reader_gone(*args)
    assert read.stdout, read.stderr  # it does print: the pipe is what is tested
    assert (gone.returncode, "Traceback" in gone.stderr) == (read.returncode, False), gone.stderr[-3000:]


def test_validate_and_healthcheck_with_a_closed_stdout_keep_their_exit_codes(tmp_path):
    """`validate | head -1` on a passing run is 0; `healthcheck | head -1` is 0 and the node is not 'broken'."""
    selection = ["--expect-gpus", "0", "--nproc", "1", "--tier", "full", "-k", "all_reduce and sum-float32",
                 "--max-check-bytes", "64K", "--timeout", "60"]
    gone = _reader_gone("validate", "--reports", str(tmp_path / "v"), *selection)
    assert (gone.returncode, "Traceback" in gone.stderr) == (0, False), gone.stderr[-3000:]
    gone = _reader_gone("healthcheck", "--scheduler", "none", "--node", "n2", "--reports", str(tmp_path / "h"),
                        *selection)
    assert (gone.returncode, "Traceback" in gone.stderr) == (0, False), gone.stderr[-3000:]
    prom = (tmp_path / "h" / "latest" / BROKEN_FILE).read_text()
    assert f"{BROKEN_METRIC} 0" in prom, prom
