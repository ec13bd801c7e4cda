"""The run's final word, settled once by whoever started the ranks (stackproof's launcher, scripts/torchrun,
scripts/slurm through `stackproof verdict`): report.json as rank 0 left it, plus what only the launcher saw
(a rank that died, an interruption, the run's time limit). The exit code is the settled report's."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import IO, Any

from stackproof.errors import ConfigError, Exit
from stackproof.judge.findings import Finding
from stackproof.report import folders, outputs, terminal
from stackproof.report.record import REPORT_FILE, UNREADABLE_FILE, Report, ReportUnreadable, stale_outputs

STOPPED_BY_LAUNCHER = (signal.SIGTERM, signal.SIGKILL)
# A run's rank logs, NCCL's log and the report take a few MiB; less free space than this fails mid-run.
MIN_FREE_BYTES = 16 << 20
LOCK_FILE = ".stackproof.lock"


class Claim:
    """A run's hold on its reports folder: an flock on a file in it, held for the run. The kernel drops it when
    the process ends, however it ends, so a crashed run never blocks the next one."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd
        self.folder = path.parent  # where the run writes (its own folder under --reports with --keep-runs)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def claim(reports_dir: Path, nnodes: int = 1) -> Claim:
    """Take the folder for this run, or refuse (exit 2) naming the run that holds it. The nodes of one multi-node
    run may share a folder (each node's launcher claims it): they share the lock, which a single-node run then
    cannot take (nor they while one holds it); two multi-node runs on one folder are not told apart."""
    path = reports_dir / LOCK_FILE
    shared = nnodes > 1
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except PermissionError:  # left by another uid (a host run before a container run): flock needs no write
            fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise ConfigError(f"--reports {reports_dir}: expected a folder this user ({os.getuid()}) can write, found "
                          f"{path.name}: {err.strerror or err}; fix: pass a writable --reports DIR") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as err:
        said = os.pread(fd, 4096, 0).decode(errors="replace").strip().splitlines()
        holder = "; ".join(said[-3:]) or "a run that has not said who it is"
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(f"--reports {reports_dir}: expected a folder that can be locked for the run, found "
                              f"flock failing on {path.name}: {err.strerror or err}; fix: pass a --reports DIR on a "
                              "filesystem with locks (a local disk, or NFS with its lock service)") from None
        raise ConfigError(f"--reports {reports_dir}: expected a folder no other run is using, found {holder} "
                          f"writing there ({path.name} is locked); fix: wait for it to finish, or give this run a "
                          "folder of its own (--reports DIR)") from None
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    line = f"stackproof run pid {os.getpid()} on {socket.gethostname()}, started {started}"
    with contextlib.suppress(OSError):  # who holds it, for the run that is refused (best effort)
        if shared:  # the other nodes of this run may have written theirs
            os.pwrite(fd, f"{line} (node of a {nnodes}-node run)\n".encode(), os.fstat(fd).st_size)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{line}\n".encode(), 0)
    return Claim(path, fd)


def unwritable(reports_dir: Path) -> str | None:
    """Why the folder cannot take a run (what was found), or None: it exists or can be made, this user can
    write it, and it has room."""
    try:
        reports_dir.mkdir(parents=True, exist_ok=True)
        probe = reports_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        free = shutil.disk_usage(reports_dir).free
    except OSError as err:
        return f"not writable by this user ({os.getuid()}): {err.strerror or err}"
    if free < MIN_FREE_BYTES:
        return f"{free >> 10} KiB free, less than the {MIN_FREE_BYTES >> 20} MiB the report and the rank logs need"
    return None


def prepare(reports_dir: Path, nnodes: int = 1, keep_runs: int = 0) -> Claim:
    """Before a run: the folder exists, is writable, has room, is this run's alone (hold the Claim until the
    verdict is settled), and no verdict of an earlier run is left in it. keep_runs > 0: the run's folder is a new
    one under reports_dir (report/folders.py; Claim.folder), and runs past the newest keep_runs are removed."""
    problem = unwritable(reports_dir)
    if problem:
        raise ConfigError(f"--reports {reports_dir}: expected a folder this user can write with room for the "
                          f"run, found it {problem}; fix: pass a writable --reports DIR on a disk with room")
    root = reports_dir
    if keep_runs:
        try:
            reports_dir = folders.new_run(root)
        except OSError as err:
            raise ConfigError(f"--reports {root}: expected to make this run's folder under {folders.RUNS}/, found "
                              f"{err.strerror or err}; fix: pass a writable --reports DIR") from None
    held = claim(reports_dir, nnodes)
    try:
        for name in stale_outputs():
            (reports_dir / name).unlink(missing_ok=True)
        if keep_runs:
            folders.prune(root, keep_runs, LOCK_FILE)
        else:
            folders.written_here(root)
    except OSError as err:
        held.release()
        raise ConfigError(f"--reports {reports_dir}: expected a folder this user ({os.getuid()}) can write, found "
                          f"{err.strerror or err}; fix: pass a writable --reports DIR") from None
    return held


def settle(reports_dir: Path, *, launcher_exit: int | None = None, failures: list[dict[str, Any]] | None = None,
           interrupted: str | None = None, timed_out_s: float | None = None, rendezvous: str | None = None,
           refused: list[int] | None = None, phases: dict[str, float] | None = None,
           findings: list[Finding] | None = None) -> Report:
    """The record as rank 0 left it, plus what only the launcher saw: `failures` (ranks that died), `refused`
    (ranks that refused their input: bad input), `phases` (steps only the launcher times), `findings` (what only
    the launcher found, e.g. a rank SIGKILL could not end). Read once, written once (when anything was added)."""
    kept = False
    try:
        report = Report.load(reports_dir) or Report()
    except ReportUnreadable as err:
        report, kept = _keep_unreadable(reports_dir, err), True
    before = report.to_json()["exit_code"], report.override
    if report.complete and not (interrupted and report.exit_code == Exit.INTERRUPTED):
        pass  # rank 0 wrote its verdict: what happened after that cannot change it
    elif interrupted:
        report.override = (Exit.INTERRUPTED, f"interrupted by {interrupted} after {len(report.checks)} of "
                                             f"{len(report.planned) or '?'} checks")
    elif timed_out_s is not None:
        report.override = (Exit.INCOMPLETE, f"the run exceeded --run-timeout {timed_out_s:.0f} s and was stopped; "
                                            f"rank logs: {reports_dir}/logs/")
    elif refused and not report.override:
        report.override = (Exit.USAGE, f"rank(s) {refused} refused their input (exit {int(Exit.USAGE)}); their "
                                       f"words are above, and in {reports_dir}/logs/")
        report.complete = True
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
    if phases and report.checks:
        report.context.setdefault("phases", {}).update(phases)
    report.findings.extend(findings or [])
    if (report.to_json()["exit_code"], report.override) != before or failures or kept or findings or \
            (phases and report.checks):
        outputs.write(report, reports_dir)
    return report


def _keep_unreadable(reports_dir: Path, err: ReportUnreadable) -> Report:
    """rank 0's report.json cannot be read: keep it beside the settled report (it is the evidence) and say why."""
    kept = reports_dir / UNREADABLE_FILE
    os.replace(reports_dir / REPORT_FILE, kept)
    return Report(override=(Exit.INCOMPLETE, f"{err}; kept as {kept}; rank logs: {reports_dir}/logs/"))


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode}"


def conclude(reports_dir: Path, out: IO[str], *, launcher_exit: int | None = None,
             interrupted: str | None = None, timed_out_s: float | None = None, **seen: Any) -> Report:
    """Settle, print the table and the verdict, and return the exit code. A node whose ranks all finished (their
    logs are there) but which holds no report.json (rank 0 ran elsewhere, no shared folder) says so and exits 0;
    a folder no rank wrote to is not a pass."""
    if not reports_dir.is_dir():
        raise ConfigError(f"--reports {reports_dir}: expected the run's reports folder, found no such folder; fix: "
                          "pass the --reports DIR the run was given")
    if not (reports_dir / REPORT_FILE).exists() and not launcher_exit and not interrupted and timed_out_s is None:
        if not any((reports_dir / "logs").glob("rank*.log")):
            why = f"no report.json and no rank log in {reports_dir}: no rank of this run wrote here"
            print(f"# stackproof: {why}\n# Verdict: {Exit.INCOMPLETE.verdict} (exit code {int(Exit.INCOMPLETE)}: "
                  f"{Exit.INCOMPLETE.meaning})", file=out, flush=True)
            return Report(override=(Exit.INCOMPLETE, why), complete=True)
        why = (f"this node's ranks finished; no report.json in {reports_dir}: rank 0's node holds the verdict (or "
               "give every node one shared --reports folder)")
        print(f"# stackproof: {why}", file=out, flush=True)
        return Report(override=(Exit.OK, why), complete=True)
    report = settle(reports_dir, launcher_exit=launcher_exit, interrupted=interrupted, timed_out_s=timed_out_s,
                    **seen)
    print(f"{terminal.table(report)}\n# report: {reports_dir / 'report.json'}", file=out, flush=True)
    return report
