"""Each run in its own folder (--keep-runs, report/folders.py; issue 25 item 6): the links, the retention, a run
still going never removed, and real runs: validate three times keeps the newest two; healthcheck's drained run
stays under `last-acted` while later passing runs come and go."""

from __future__ import annotations

import datetime
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stackproof.errors import ConfigError, Healthcheck
from stackproof.report import folders
from stackproof.run import settle
from stackproof.run.config import ValidateConfig

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
ALLREDUCE = ["--expect-gpus", "0", "--nproc", "1", "--tier", "full", "-k", "all_reduce and sum-float32",
             "--max-check-bytes", "64K", "--timeout", "60"]
QUICK = ["--expect-gpus", "0", "--nproc", "1", "-k", "barrier", "--timeout", "60"]


def _at(minute: int) -> datetime.datetime:
    return datetime.datetime(2026, 12, 1, 10, minute, tzinfo=datetime.timezone.utc)


def test_a_new_run_gets_a_folder_that_sorts_by_start_and_latest_points_at_it(tmp_path):
    first = folders.new_run(tmp_path, _at(1))
    second = folders.new_run(tmp_path, _at(2))
    assert first.parent == second.parent == tmp_path / folders.RUNS and first.name < second.name
    assert (tmp_path / folders.LATEST).is_symlink() and folders.current(tmp_path) == second.resolve()
    assert not os.readlink(tmp_path / folders.LATEST).startswith("/")  # relative: the folder can move
    assert folders.current(tmp_path / "elsewhere") == tmp_path / "elsewhere"  # no runs kept: the folder itself


def test_prune_keeps_the_newest_the_last_acted_and_a_run_still_going(tmp_path):
    runs = [folders.new_run(tmp_path, _at(m)) for m in range(6)]
    folders.link(tmp_path, folders.LAST_ACTED, runs[0])
    going = runs[1] / settle.LOCK_FILE
    fd = os.open(going, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as settle.claim holds it (another open file description: a lock)
    try:
        removed = folders.prune(tmp_path, 2, settle.LOCK_FILE)
    finally:
        os.close(fd)
    assert sorted(p.name for p in removed) == sorted(r.name for r in runs[2:4])
    assert sorted(p.name for p in (tmp_path / folders.RUNS).iterdir()) == sorted(
        r.name for r in (runs[0], runs[1], runs[4], runs[5]))


def test_prepare_makes_the_runs_folder_and_the_claim_names_it(tmp_path):
    held = settle.prepare(tmp_path, keep_runs=3)
    try:
        assert held.folder.parent == tmp_path / folders.RUNS and folders.current(tmp_path) == held.folder.resolve()
        assert (held.folder / settle.LOCK_FILE).exists()
    finally:
        held.release()
    plain = settle.prepare(tmp_path / "plain")
    plain.release()
    assert plain.folder == tmp_path / "plain"  # --keep-runs 0: the folder itself, as before


def test_a_run_written_into_a_folder_that_kept_runs_is_what_readers_read(tmp_path):
    """Issue 36 item 3: after `validate --reports DIR` into a folder a healthcheck used, verdict, act and report
    followed the old `latest` to the healthcheck's failed run."""
    from stackproof.report.record import Check, Report, read_report

    kept = settle.prepare(tmp_path, keep_runs=3)
    Report(checks=[Check("t.py::old", "failed")], complete=True).write(kept.folder)
    kept.release()
    plain = settle.prepare(tmp_path)
    Report(checks=[Check("t.py::new", "passed")], complete=True).write(plain.folder)
    plain.release()
    assert folders.current(tmp_path) == tmp_path.resolve()
    assert [c["name"] for c in read_report(tmp_path)["checks"]] == ["t::new"]
    again = settle.prepare(tmp_path, keep_runs=3)  # a healthcheck after it: latest is its run again
    again.release()
    assert folders.current(tmp_path) == again.folder.resolve()
    assert len(list((tmp_path / folders.RUNS).iterdir())) == 2


def test_keep_runs_is_one_node_only():
    with pytest.raises(ConfigError, match="--keep-runs 3: expected one node, found --nnodes 2"):
        ValidateConfig(keep_runs=3, nnodes=2, node_rank=0, master_addr="h")


def _run(*argv: str, env: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "STACKPROOF_", "PET_"))}
    return subprocess.run([PYTHON, "-m", "stackproof", *argv], capture_output=True, text=True, timeout=240,
                          env={**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd)


def test_validate_three_times_keeps_the_newest_two(tmp_path):
    for _ in range(3):
        proc = _run("validate", "--keep-runs", "2", "--reports", str(tmp_path / "r"), *QUICK, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted((tmp_path / "r" / folders.RUNS).iterdir())
    assert len(runs) == 2 and all((r / "report.json").exists() for r in runs)
    assert folders.current(tmp_path / "r") == runs[-1].resolve()
    assert (tmp_path / "r" / folders.LATEST / "stackproof.prom").exists()  # where node_exporter reads
    assert f"reports: {runs[-1]}" in proc.stdout
    # Readers given the folder read its newest run: launchers' verdict (burn-in.sbatch), spec, report, act.
    verdict = _run("verdict", "--reports", str(tmp_path / "r"), cwd=tmp_path)
    assert verdict.returncode == 0 and f"# report: {runs[-1]}" in verdict.stdout, verdict.stdout[-2000:]


def test_the_run_healthcheck_acted_on_outlives_later_runs(tmp_path):
    """A drain (here: would be, --scheduler none; all_reduce broken underneath), then passing runs:
    last-acted still names the drained run, whose report says why, and the passing ones rotate."""
    reports = tmp_path / "hc"
    failed = _run("healthcheck", "--scheduler", "none", "--node", "n1", "--keep-runs", "2", "--reports",
                  str(reports), *ALLREDUCE, env={"PYTHONPATH": f"{BROKEN_ALLREDUCE}:{REPO}"}, cwd=tmp_path)
    assert failed.returncode == Healthcheck.TAKEN_OUT, failed.stdout[-3000:] + failed.stderr[-3000:]
    acted = folders.pointed(reports, folders.LAST_ACTED)
    assert acted is not None and (acted / "report.json").exists(), failed.stdout[-3000:]
    for _ in range(2):
        passed = _run("healthcheck", "--scheduler", "none", "--node", "n1", "--keep-runs", "2", "--reports",
                      str(reports), *QUICK, cwd=tmp_path)
        assert passed.returncode == Healthcheck.STAYS, passed.stdout[-3000:] + passed.stderr[-3000:]
    assert folders.pointed(reports, folders.LAST_ACTED) == acted and acted.exists()
    kept = sorted((reports / folders.RUNS).iterdir())
    assert folders.current(reports) != acted and len(kept) == 3 and kept[0].resolve() == acted  # 2 newest + it
    assert '"exit_code": 1' in (acted / "report.json").read_text()
