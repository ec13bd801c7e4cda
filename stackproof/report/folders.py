"""Each run in its own folder (--keep-runs N): <reports>/runs/<started>-<pid>/, with two links beside runs/:
`latest` (the newest run, the one going or the last to finish: point node_exporter's textfile collector there;
`.` after a run written into the folder itself)
and `last-acted` (the run healthcheck last took action on: its evidence outlives the hourly runs after it).
The newest N runs are kept, and the one `last-acted` names whatever its age; a run still going (its folder
locked by settle.claim) is never removed."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import shutil
from pathlib import Path

RUNS = "runs"
LATEST = "latest"
LAST_ACTED = "last-acted"


def new_run(root: Path, now: datetime.datetime | None = None) -> Path:
    """Make this run's folder under root/runs (named so that names sort as the runs started) and point `latest`
    at it."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    name = f"{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{os.getpid()}"
    run = root / RUNS / name
    run.mkdir(parents=True)
    link(root, LATEST, run)
    return run


def written_here(root: Path) -> None:
    """A run written into root itself (no --keep-runs): a `latest` left there by runs that kept their folders
    names root now, so that readers (verdict, act, report, node_exporter) read this run, not an older one."""
    if (root / LATEST).is_symlink():
        link(root, LATEST, root)


def link(root: Path, name: str, run: Path) -> None:
    """root/name -> runs/<run>, replaced atomically (a reader sees the old run or the new one, never none)."""
    tmp = root / f".{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(run, root), tmp)
    os.replace(tmp, root / name)


def current(root: Path) -> Path:
    """The folder a reader of root's newest run should read: root/latest's run when root keeps runs, else root."""
    latest = root / LATEST
    return latest.resolve() if latest.is_symlink() else root


def pointed(root: Path, name: str) -> Path | None:
    path = root / name
    return path.resolve() if path.is_symlink() else None


def prune(root: Path, keep: int, lock_file: str) -> list[Path]:
    """Remove the oldest runs beyond the newest `keep`, never the one a link names nor one still going; the
    removed folders."""
    runs = sorted((p for p in (root / RUNS).iterdir() if p.is_dir()), key=lambda p: p.name) \
        if (root / RUNS).is_dir() else []
    kept = {pointed(root, LATEST), pointed(root, LAST_ACTED)}
    removed = []
    for run in runs[:max(0, len(runs) - keep)]:
        if run.resolve() in kept or _going(run / lock_file):
            continue
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


def _going(lock: Path) -> bool:
    """A run holds its folder's lock while it goes (settle.claim): a lock we can take means it is over."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
