"""The circuit breaker's lock on Slurm: one node at a time counts the drained nodes and drains itself. An flock
on a file every node of the pool sees (--breaker-lock: NFS with its lock service, Lustre, GPFS, CephFS), waited
for at most a timeout. The kernel (or the NFS lock service) drops it when the process ends, however it ends.
And healthcheck's claim on its node's reports folder (only_one): one healthcheck at a time judges a node."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from stackproof.errors import ActError


@contextlib.contextmanager
def held(path: Path | None, timeout_s: float) -> Iterator[float]:
    """Hold the lock at `path` for the block (nothing to hold when None); yields the seconds waited. ActError
    when it cannot be opened or locked, or another node holds it past `timeout_s` (the error names the holder)."""
    if path is None:
        yield 0.0
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    except OSError as err:
        raise ActError(f"--breaker-lock {path}: expected a file every node can open on shared storage, found "
                       f"{err.strerror or err}; fix: point it at a writable path on the cluster's shared "
                       "filesystem") from None
    start = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start > timeout_s:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a node that did not say"
                    raise ActError(f"--breaker-lock {path}: expected the lock within {timeout_s:g} s, found it held "
                                   f"by {holder}; fix: raise --act-timeout, or look for a hung healthcheck "
                                   "there") from None
                time.sleep(random.uniform(0.02, 0.1))  # spread the nodes' retries
            except OSError as err:
                raise ActError(f"--breaker-lock {path}: expected a file that can be locked, found flock failing: "
                               f"{err.strerror or err}; fix: a filesystem with locks (NFS with its lock "
                               "service)") from None
        waited = time.monotonic() - start
        with contextlib.suppress(OSError):  # who holds it, for the node that times out (best effort)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}\n".encode(), 0)
        yield waited
    finally:
        os.close(fd)


HEALTHCHECK_LOCK = ".stackproof-healthcheck.lock"  # in the reports folder; run/settle.py's run lock is another file
HOLDER_WORDS_S = 2.0  # how long a healthcheck that finds the lock held waits for its holder to say who it is


@contextlib.contextmanager
def only_one(reports_dir: Path) -> Iterator[str]:
    """One healthcheck at a time on a reports folder (a node's), for the whole command: its survey, its ranks and
    its act. Yields "" when this command holds it, or who holds it (their words) when another healthcheck does,
    without waiting: that one is judging the node. A folder that cannot carry the lock (not there and not
    makeable, a filesystem without flock) yields "" too: the run then meets the folder's problem and says it."""
    try:
        reports_dir.mkdir(parents=True, exist_ok=True)
        path = reports_dir / HEALTHCHECK_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except PermissionError:  # left by another uid, or a read-only folder: flock needs no write
            fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield ""
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield _holder(fd) or f"{path} is held"
            return
        except OSError:
            yield ""
            return
        with contextlib.suppress(OSError):  # who holds it, for the healthcheck that finds it held (best effort)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}".encode(), 0)
        try:
            yield ""
        finally:
            with contextlib.suppress(OSError):  # still held: words left behind would name a holder that is gone
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """The holder's words. A holder writes them just after it takes the lock and clears them just before it lets
    go, so a file found empty is one whose holder is between flock and write: wait for the words, briefly."""
    give_up = time.monotonic() + HOLDER_WORDS_S
    while not (words := os.pread(fd, 4096, 0).decode(errors="replace").strip()) and time.monotonic() < give_up:
        time.sleep(0.01)
    return words
