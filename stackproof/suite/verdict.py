"""The run's final word, settled once by whoever started the ranks (stackproof's launcher, scripts/torchrun,
scripts/slurm through `stackproof verdict`): report.json as rank 0 left it, plus what only the launcher saw
(a rank that died, an interruption, the run's time limit). The exit code is the settled report's."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import IO, Any

from stackproof.errors import Exit
from stackproof.suite.report import Report, stale_outputs

STOPPED_BY_LAUNCHER = (signal.SIGTERM, signal.SIGKILL)


def prepare(reports_dir: Path) -> None:
    """Before a run: the folder exists and is writable, and no verdict of an earlier run is left in it."""
    from stackproof.errors import ConfigError

    try:
        reports_dir.mkdir(parents=True, exist_ok=True)
        probe = reports_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        for name in stale_outputs():
            (reports_dir / name).unlink(missing_ok=True)
    except OSError as err:
        raise ConfigError(f"--reports {reports_dir}: expected a folder this user ({os.getuid()}) can write, found "
                          f"{err.strerror or err}; fix: pass a writable --reports DIR") from None


def settle(reports_dir: Path, *, launcher_exit: int | None = None, failures: list[dict[str, Any]] | None = None,
           interrupted: str | None = None, timed_out_s: float | None = None, rendezvous: str | None = None) -> Report:
    report = Report.load(reports_dir) or Report()
    before = report.to_json()["exit_code"], report.override
    if report.complete and not (interrupted and report.exit_code == Exit.INTERRUPTED):
        pass  # rank 0 wrote its verdict: what happened after that cannot change it
    elif interrupted:
        report.override = (Exit.INTERRUPTED, f"interrupted by {interrupted} after {len(report.checks)} of "
                                             f"{len(report.planned) or '?'} checks")
    elif timed_out_s is not None:
        report.override = (Exit.INCOMPLETE, f"the run exceeded --run-timeout {timed_out_s:.0f} s and was stopped; "
                                            f"rank logs: {reports_dir}/logs/")
    elif rendezvous and not report.override:
        report.override = (Exit.INCOMPLETE, f"{rendezvous}; every node must start the same command within "
                                            "--rendezvous-timeout (a missing or late node, a wrong --master-addr "
                                            "or --rdzv-endpoint)")
    elif failures and not report.override:
        # torchrun stops the others with SIGTERM once one fails: name the ranks that went first.
        first = [f for f in failures if -f["exitcode"] not in STOPPED_BY_LAUNCHER] or failures
        died = "; ".join(f"{report.where(f['rank'])} exited with {_how(f['exitcode'])}" for f in first)
        report.override = (Exit.INCOMPLETE, f"{died}, so the run stopped; its log: {reports_dir}/logs/")
    elif launcher_exit not in (None, 0) and not report.override:
        report.override = (Exit.INCOMPLETE, f"the launcher exited {launcher_exit} before rank 0 wrote a verdict (a "
                                            f"rank died or was stopped); rank logs: {reports_dir}/logs/")
    if failures:
        report.context["launcher_failures"] = failures
    if (report.to_json()["exit_code"], report.override) != before or failures:
        report.write(reports_dir)
    return report


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode}"


def conclude(reports_dir: Path, out: IO[str], *, launcher_exit: int | None = None,
             interrupted: str | None = None, timed_out_s: float | None = None) -> Exit:
    """Settle, print the table and the verdict, and return the exit code. A node whose ranks all finished but
    which holds no report.json (rank 0 ran elsewhere, no shared folder) says so and exits 0."""
    if not (reports_dir / "report.json").exists() and not launcher_exit and not interrupted and timed_out_s is None:
        print(f"# stackproof: this node's ranks finished; no report.json in {reports_dir}: rank 0's node holds the "
              "verdict (or give every node one shared --reports folder)", file=out, flush=True)
        return Exit.OK
    report = settle(reports_dir, launcher_exit=launcher_exit, interrupted=interrupted, timed_out_s=timed_out_s)
    print(f"{report.table()}\n# report: {reports_dir / 'report.json'}", file=out, flush=True)
    return report.exit_code
