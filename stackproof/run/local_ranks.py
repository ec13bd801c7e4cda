"""The one way stackproof starts the ranks of a single-node run (validate, bench resnet): one process per rank,
with the variables torchrun's standalone mode gives them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/PORT; rank 0 hosts the store), but without torchrun's agent process in between, so no
torch import delays them: every rank starts importing torch at once.

Each rank runs in a session of its own. When a rank exits non-zero the others are stopped (torchrun's rule), and
the ones that failed first are named (rank, exit code, pid); on --run-timeout or a signal every rank's process
group is stopped, SIGTERM first, then SIGKILL, so no worker is left holding a GPU. Multi-node runs and ranks
started by the user's own torchrun or srun keep torchrun's agent (stackproof/run/agent.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stackproof import environment
from stackproof.run.launch_env import RUN_ENDS_ENV

KILL_GRACE_S = 10.0
# How long a rank's exit is awaited after SIGKILL. A process the kernel cannot kill (uninterruptible sleep in the
# driver after an XID 79, or on a dead mount) never exits: it is named and the run goes on to settle and act.
KILL_WAIT_S = 2.0
POLL_S = 0.05
# Set in each rank's environment: the number of a pipe's write end the rank inherits. A rank whose record is
# written and flushed, and that has nothing left to say to its peers, writes one line there (leaving()) just before
# it exits, so the launcher times the ranks' own teardown (the process's exit: CUDA's context and the driver's
# memory given back) and bounds it.
LEAVING_FD_ENV = environment.LEAVING_FD.name
# How long ranks that all said they are leaving may take to be gone before they are stopped (SIGKILL, then
# KILL_WAIT_S): what is left is the kernel's and the driver's teardown of the process, well under this on a
# healthy node (benchmarks/startup.py prints it: "records complete -> ranks gone").
LEAVE_WAIT_S = KILL_GRACE_S


@dataclasses.dataclass
class Outcome:
    exit_code: int  # 0 when every rank exited 0; else the first failure's code (-N: signal N), -1 on timeout
    failures: list[dict]  # {"rank", "local_rank", "exitcode", "pid"} of the ranks that failed first
    interrupted: str | None = None  # the signal that stopped the run
    timed_out: bool = False
    # Ranks still there KILL_WAIT_S after SIGKILL: {"rank", "pid", "state", "wchan"} (stuck_rank's words).
    unkillable: list[dict] = dataclasses.field(default_factory=list)
    # When the last rank said it was leaving (ranks_done, epoch seconds: every record complete), for report.json's
    # phases and benchmarks/startup.py: what follows it is the processes' own teardown.
    left: dict[str, float] = dataclasses.field(default_factory=dict)


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str]) -> dict[str, str]:
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leaving(rank: int, code: int) -> None:
    """In a rank: say that this rank leaves now with `code`, its record written and flushed (see LEAVING_FD_ENV).
    Nothing when no launcher of ours listens; a launcher gone first is not waited for."""
    fd = _leaving_fd
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps({"rank": rank, "exit": int(code), "at": time.time()}) + "\n").encode())


def take_leaving_fd() -> None:
    """In a rank, at its start: keep the pipe the launcher named (LEAVING_FD_ENV) and take the name out of the
    environment, so that no process the rank starts writes to an fd of that number."""
    global _leaving_fd
    value = environment.forget(LEAVING_FD_ENV).get(LEAVING_FD_ENV)
    with contextlib.suppress(ValueError, OSError):
        fd = int(value or "")
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            _leaving_fd = fd


_leaving_fd: int | None = None


def _said(fd: int, buffer: bytearray) -> list[dict]:
    """The lines the ranks wrote to the leaving pipe since last asked (non-blocking)."""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            buffer += chunk
    lines = []
    while b"\n" in buffer:
        line, _, rest = bytes(buffer).partition(b"\n")
        buffer[:] = rest
        with contextlib.suppress(ValueError):
            said = json.loads(line)
            if isinstance(said, dict) and isinstance(said.get("rank"), int) and isinstance(said.get("exit"), int):
                lines.append(said)
    return lines


def run(command: Sequence[str], nproc: int, env: dict[str, str], timeout_s: float,
        logs: Path | None = None, start: Callable[..., Any] | None = None) -> Outcome:
    """Start `nproc` ranks of `command` and wait for all of them (or the first failure, a signal, the timeout).
    With `logs`, each rank's stdout and stderr go to logs/rank<N>.log instead of this process's. `start`: how a
    rank is started instead of a subprocess (run/warm.py: forked by the warm agent), called as
    start(command, env, stdout, leaving_fd) and returning an object with Popen's pid, poll() and wait(timeout),
    and signal_group(signum). Ranks that all said they are leaving (leaving()) and are not gone LEAVE_WAIT_S later
    are stopped, with the exit code each said."""
    base = dict(env)
    # Share the cores between ranks (torchrun would pin each to one thread, with a warning).
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    base[RUN_ENDS_ENV] = f"{time.time() + timeout_s:.3f}"  # the ranks' watchdog fires before the stop below
    port = free_port()
    interrupted: list[str] = []
    procs: list[subprocess.Popen] = []
    stuck: dict[int, dict] = {}  # by rank: each rank that outlived SIGKILL, as first seen
    heard, write_end = os.pipe()  # the ranks' "leaving" lines (leaving())
    os.set_blocking(heard, False)
    base[LEAVING_FD_ENV] = str(write_end)
    said: dict[int, dict] = {}  # by rank: its leaving line
    buffer = bytearray()
    left: dict[str, float] = {}

    def stop(signum: int) -> None:
        for record in _stop(procs, signum, skip=set(stuck)):
            stuck.setdefault(record["rank"], record)

    def stop_signal(signum: int, _frame: object) -> None:
        interrupted.append(signal.Signals(signum).name)
        stop(signum)

    def outcome(*args, **kwargs) -> Outcome:
        stop(signal.SIGKILL)  # nothing outlives the launcher, whatever happened; what cannot die is named
        return Outcome(*args, **kwargs, unkillable=sorted(stuck.values(), key=lambda r: r["rank"]), left=left)

    previous = {sig: signal.signal(sig, stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nproc):
            with contextlib.ExitStack() as files:
                output = None
                if logs is not None:
                    logs.mkdir(parents=True, exist_ok=True)
                    output = files.enter_context(open(logs / f"rank{rank}.log", "wb"))
                if start is not None:
                    procs.append(start(list(command), rank_env(rank, nproc, port, base), output, write_end))
                    continue
                procs.append(subprocess.Popen(list(command), env=rank_env(rank, nproc, port, base),
                                              start_new_session=True, stdout=output, pass_fds=(write_end,),
                                              stderr=subprocess.STDOUT if output else None))
        os.close(write_end)  # the ranks hold it now
        write_end = -1
        deadline = time.monotonic() + timeout_s
        leave_by = None
        while True:
            codes = [proc.poll() for proc in procs]
            for line in _said(heard, buffer):
                said.setdefault(line["rank"], line)
            if leave_by is None and set(said) >= set(range(nproc)):  # every record complete: only the teardown is left
                left["ranks_done"] = max(float(line.get("at") or 0.0) for line in said.values()) or time.time()
                leave_by = time.monotonic() + LEAVE_WAIT_S
            if leave_by is not None and time.monotonic() > leave_by and None in codes:
                codes = [code if code is not None else said[rank]["exit"] for rank, code in enumerate(codes)]
            if interrupted:
                stop(signal.SIGTERM)
                return outcome(128 + signal.Signals[interrupted[0]].value, [], interrupted[0])
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                stop(signal.SIGTERM)
                failures = [{"rank": r, "local_rank": r, "exitcode": codes[r], "pid": procs[r].pid} for r in failed]
                return outcome(int(codes[failed[0]]), failures)
            if all(code == 0 for code in codes):
                return outcome(0, [])
            if time.monotonic() > deadline:
                stop(signal.SIGTERM)
                return outcome(-1, [], timed_out=True)
            time.sleep(POLL_S)
    finally:
        stop(signal.SIGKILL)  # also on an exception above
        for fd in (heard, write_end):
            if fd >= 0:
                os.close(fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(procs: list[subprocess.Popen], signum: int, skip: set[int] = frozenset()) -> list[dict]:
    """Signal every rank's process group (the rank and whatever it started), then wait; SIGKILL after the grace,
    and then at most KILL_WAIT_S. The ranks still there after that (the kernel cannot kill them), as stuck_rank
    words them; ranks in `skip` (known stuck already) are signalled, not awaited again."""
    for proc in procs:
        _signal_group(proc, signum)
    procs = [proc if rank not in skip else None for rank, proc in enumerate(procs)]
    deadline = time.monotonic() + (KILL_GRACE_S if signum != signal.SIGKILL else 0.0)
    for proc in filter(None, procs):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
    stuck = []
    kill_deadline = time.monotonic() + KILL_WAIT_S
    for rank, proc in enumerate(procs):
        if proc is None:
            continue
        if not reap(proc, max(0.0, kill_deadline - time.monotonic())):
            stuck.append(stuck_rank(rank, proc.pid))
        _signal_group(proc, signal.SIGKILL)  # the rank exited (or cannot): what it started goes with it
    return stuck


def reap(proc: subprocess.Popen, within_s: float) -> bool:
    """Wait for a process that was sent SIGKILL, at most `within_s`: whether it is gone."""
    try:
        proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def stuck_rank(rank: int, pid: int) -> dict:
    """A rank that outlived SIGKILL, with what the kernel says it waits in (/proc: its state, e.g. D, and the
    kernel function it sleeps in), so the finding says where it is stuck."""
    state = wchan = "n/a"
    with contextlib.suppress(OSError, IndexError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    with contextlib.suppress(OSError):
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "n/a"
    return {"rank": rank, "pid": pid, "state": state, "wchan": wchan}


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if hasattr(proc, "signal_group"):  # a warm rank: its agent signals it (run/warm.py)
        proc.signal_group(signum)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(proc.pid, signum)
