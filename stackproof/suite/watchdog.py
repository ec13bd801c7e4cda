"""A per-check watchdog that names the rank stalling the others.

A rank blocked inside a GPU collective cannot report anything itself, and NCCL's own timeout may never return
control to Python. So a thread on every rank wakes up when a check has run too long, looks at where its main
thread is, and posts that to the store: ranks waiting inside torch.distributed (or stackproof's cross-rank sync)
are victims; a rank anywhere else is the one that stalled them. Rank 0 collects the answers, writes the
verdict and ends the run (exit 4); the launcher stops the other ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stackproof.suite.dist import DistEnv

# Frames in these files mean "waiting for the other ranks".
_WAITING_IN = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"stackproof{os.sep}suite{os.sep}dist.py")
_OURS = ("smoke_tests", f"stackproof{os.sep}")
# How long rank 0 waits for the others' answers once it has fired.
ANSWER_WAIT_S = 10.0


def main_thread_position() -> tuple[bool, str]:
    """(waiting for peers?, the innermost frame of the suite's own code, as file:line in function)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    waiting, where = False, "unknown"
    while frame is not None:
        path = frame.f_code.co_filename
        if any(marker in path for marker in _WAITING_IN):
            waiting = True
        if where == "unknown" and any(marker in path for marker in _OURS) and "watchdog" not in path:
            where = f"{Path(path).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return waiting, where


class CheckWatchdog:
    """Arm it around one check; `on_stall(nodeid, message)` runs on rank 0 if the check outlives `limit_s`."""

    def __init__(self, env: DistEnv, limit_s: float, on_stall: Callable[[str, str], None]):
        self.env, self.limit_s, self.on_stall = env, limit_s, on_stall
        self._timer: threading.Timer | None = None
        self._seq = 0

    def arm(self, what: str) -> None:
        self._seq += 1
        self._timer = threading.Timer(self.limit_s, self._fire, args=(self._seq, what))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, seq: int, what: str) -> None:
        waiting, where = main_thread_position()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=False)  # the full stack, into this rank's log
        store = self.env.side_store or self.env.store
        store.set(f"stall/{seq}/{self.env.rank}", json.dumps({"waiting": waiting, "where": where}))
        if not self.env.is_main:
            return  # rank 0 reports; the launcher then stops this rank
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline and len(answers) < self.env.world_size:
            for rank in range(self.env.world_size):
                key = f"stall/{seq}/{rank}"
                if rank not in answers and store.check([key]):
                    answers[rank] = json.loads(store.get(key))
            time.sleep(0.2)
        self.on_stall(what, stall_message(what, self.limit_s, self.env.world_size, answers))


def stall_message(what: str, limit_s: float, world_size: int, answers: dict[int, dict]) -> str:
    stalled = sorted(r for r, a in answers.items() if not a["waiting"])
    waiting = sorted(r for r, a in answers.items() if a["waiting"])
    silent = sorted(set(range(world_size)) - set(answers))
    parts = []
    if stalled:
        places = "; ".join(f"rank {r} at {answers[r]['where']}" for r in stalled)
        parts.append(f"rank(s) {stalled} stalled outside any collective ({places})")
    if silent:
        parts.append(f"rank(s) {silent} did not answer (dead, or stuck past this check)")
    if waiting:
        parts.append(f"rank(s) {waiting} were waiting for them in a collective")
    return (f"{what} did not finish within {limit_s:.0f} s: " + "; ".join(parts)
            + "; stacks are in the rank logs; raise the limit with --timeout")
