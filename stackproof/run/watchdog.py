"""A per-check watchdog that names the rank stalling the others.

A rank blocked inside a GPU collective cannot report anything itself, and NCCL's own timeout may never return
control to Python. So a thread on every rank wakes up when a check has run too long, looks at where its main
thread is, and posts that to the store: ranks waiting inside torch.distributed (or stackproof's cross-rank sync)
are victims; a rank anywhere else is the one that stalled them. Rank 0 collects the answers, writes the
verdict and ends the run (exit 4); the launcher stops the other ranks.

Before it answers, each rank writes the stack of every one of its threads into its own log (`send_stacks_to`,
set by the worker to the log itself: pytest captures stderr during a check, and a rank that is stopped takes
what it captured with it). So the stalled rank's log shows where it is stuck, and the waiting ranks' logs the
collective they wait in.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch.distributed

import stackproof
from stackproof import environment
from stackproof.judge import hang
from stackproof.judge.findings import Finding
from stackproof.measure import identity, stall
from stackproof.run import dist as _dist
from stackproof.run.launch_env import STALL_LOOK_S, VERDICT_S

# Where frames mean "waiting for the other ranks" (torch.distributed, stackproof's own sync), and where the
# suite's own code lives: whole directories, resolved, so a checkout in a folder named "stackproof" or a venv
# inside the checkout cannot be mistaken for either.
_WAITING_IN = (Path(torch.distributed.__file__).resolve().parent, Path(_dist.__file__).resolve())
_PACKAGE = Path(stackproof.__file__).resolve().parent
_CUDA = Path(torch.cuda.__file__).resolve().parent  # torch.cuda's code: synchronize, streams, events
_THIS = Path(__file__).resolve()
# How long rank 0 waits for the others' answers once it has fired.
ANSWER_WAIT_S = 10.0
# Where a rank's stacks go when its watchdog fires (send_stacks_to); stderr until the worker says.
_stacks: IO[str] | None = None


def send_stacks_to(log: IO[str]) -> None:
    """Every thread's stack goes to `log` (this rank's own log) when the watchdog fires, and on a fatal signal
    (faulthandler: SIGSEGV, SIGABRT, ...) too."""
    global _stacks
    _stacks = log
    faulthandler.enable(file=log, all_threads=True)


def dump_stacks(what: str, limit_s: float, rank: int) -> None:
    """Every thread of this rank, the main thread (where the check runs) among them, into its log."""
    log = _stacks or sys.stderr
    print(f"\n# stackproof watchdog: rank {rank}: {what} still running after {limit_s:g} s; the stack of every "
          "thread of this rank, most recent call first:", file=log, flush=True)
    faulthandler.dump_traceback(file=log, all_threads=True)
    log.flush()


def _within(path: Path, place: Path) -> bool:
    return path == place or place in path.parents


def main_thread_cuda_call(native: stall.Native) -> str:
    """Where the main thread is inside a CUDA call ("" where it is not): a frame of torch.cuda's code (a
    synchronize, an event or stream wait), or the thread blocked in the driver's ioctl (`native`, its /proc
    reading)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if _within(path, _CUDA):
            return f"torch.cuda {path.name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return native.syscall if native.in_gpu_driver else ""


def stall_answer(waiting: bool, where: str, gpu: dict | None, node: str = "") -> dict:
    """What a rank says when the watchdog fires: where its main thread is (Python, and below it), and, for a
    stalled rank on a GPU, what NVML says of the GPU meanwhile (judge/hang.py pins the hang, or not). `node`: the
    name the run resolved for this node (--node-name), which a drain names; the environment's only without one."""
    answer = {"waiting": waiting, "where": where, "node": node or identity.node_name(environment.current())}
    if waiting:
        return answer
    native = stall.native()
    answer.update(in_cuda=main_thread_cuda_call(native), native=f"{native.state} {native.syscall}", gpu=gpu)
    if gpu:
        activity = stall.gpu_activity(gpu["uuid"])
        answer.update(gpu_util=activity.utilization, gpu_error=activity.error)
    return answer


def position_over(look_s: float, suite_dirs: tuple[Path, ...] = (), every_s: float = 0.05) -> tuple[bool, str]:
    """main_thread_position, looked at again for up to `look_s` while the main thread is outside any collective:
    waiting at any look is waiting (a rank passing from one collective to the next); stalled only at every look."""
    until = time.monotonic() + look_s
    waiting, where = main_thread_position(suite_dirs)
    while not waiting and time.monotonic() < until:
        time.sleep(every_s)
        waiting, where = main_thread_position(suite_dirs)
    return waiting, where


def main_thread_position(suite_dirs: tuple[Path, ...] = ()) -> tuple[bool, str]:
    """(waiting for peers?, the innermost frame of the suite's own code, as file:line in function)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    ours = (_PACKAGE, *suite_dirs)
    waiting, where = False, "unknown"
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if any(_within(path, place) for place in _WAITING_IN):
            waiting = True
        if where == "unknown" and path != _THIS and any(_within(path, place) for place in ours):
            where = f"{path.name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return waiting, where


class CheckWatchdog:
    """Arm it around one check; `on_stall(nodeid, message)` runs on rank 0 if the check outlives `limit_s`."""

    def __init__(self, env: _dist.DistEnv, limit_s: float, on_stall: Callable[[str, str, list[int]], None],
                 suite_dirs: tuple[Path, ...] = (), node: str = "", run_ends: float | None = None):
        """`node`: this node's name as the run resolved it (the findings' node); `run_ends`: when the launcher stops
        the ranks (epoch seconds, launch_env.run_ends()): the watchdog fires launch_env.VERDICT_S before it, whatever
        `limit_s` says, so rank 0 names the stalled rank before the run is stopped."""
        self.env, self.limit_s, self.on_stall, self.suite_dirs = env, limit_s, on_stall, suite_dirs
        self.node, self.run_ends = node, run_ends
        self._timer: threading.Timer | None = None
        self._seq = 0
        # This rank's GPU, read now: once the main thread is stuck in CUDA, asking torch could block too.
        self.gpu = ({"index": env.device.index, "uuid": str(torch.cuda.get_device_properties(env.device).uuid)}
                    if env.is_gpu else None)
        self.findings: list[Finding] = []  # rank 0, once fired: each stalled rank's, GPU hang or tool timeout

    def fires_in(self, now: float) -> float:
        """Seconds from `now` (epoch) until the watchdog fires for a check starting then: its limit, or the run's
        end less VERDICT_S when that comes first."""
        if self.run_ends is None:
            return self.limit_s
        return max(0.0, min(self.limit_s, self.run_ends - VERDICT_S - now))

    def arm(self, what: str) -> None:
        self._seq += 1
        self._timer = threading.Timer(self.fires_in(time.time()), self._fire, args=(self._seq, what, time.time()))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, seq: int, what: str, armed: float) -> None:
        ran_s = time.time() - armed  # the limit, or less: the run's end came first
        waiting, where = position_over(STALL_LOOK_S, self.suite_dirs)
        dump_stacks(what, round(ran_s, 1), self.env.rank)  # before answering: rank 0 may end the run at once
        store = self.env.side_store or self.env.store
        store.set(f"stall/{seq}/{self.env.rank}", json.dumps(stall_answer(waiting, where, self.gpu, self.node)))
        if not self.env.is_main:
            return  # rank 0 reports; the launcher then stops this rank
        keys = [f"stall/{seq}/{rank}" for rank in range(self.env.world_size)]
        # The others' answers, but never past the run's end: the verdict must be written before the launcher stops us.
        wait_s = ANSWER_WAIT_S if self.run_ends is None else \
            max(0.5, min(ANSWER_WAIT_S, self.run_ends - time.time() - VERDICT_S / 4))
        try:
            store.wait(keys, datetime.timedelta(seconds=wait_s))
            answers = {rank: json.loads(value) for rank, value in enumerate(store.multi_get(keys))}
        except Exception:  # some rank did not answer: read those that did, one by one (only on this path)
            answers = {rank: json.loads(store.get(key)) for rank, key in enumerate(keys) if store.check([key])}
        stalled = sorted(r for r, a in answers.items() if not a["waiting"])
        silent = sorted(set(range(self.env.world_size)) - set(answers))
        self.findings = [hang.hang_finding(what, rank, answers[rank], ran_s) for rank in stalled]
        hint = ("raise the limit with --check-timeout" if ran_s >= self.limit_s - 0.5 else
                "the run's end came first: raise --run-timeout (healthcheck: --deadline)")
        self.on_stall(what, stall_message(what, ran_s, self.env.world_size, answers, hint), stalled + silent)


def stall_message(what: str, limit_s: float, world_size: int, answers: dict[int, dict],
                  hint: str = "raise the limit with --check-timeout") -> str:
    stalled = sorted(r for r, a in answers.items() if not a["waiting"])
    waiting = sorted(r for r, a in answers.items() if a["waiting"])
    silent = sorted(set(range(world_size)) - set(answers))
    parts = []
    if stalled:
        places = "; ".join(f"rank {r} at {answers[r]['where']}"
                           + (f" (in a CUDA call, {answers[r]['in_cuda']})" if answers[r].get("in_cuda") else "")
                           for r in stalled)
        parts.append(f"rank(s) {stalled} stalled outside any collective ({places})")
    if silent:
        parts.append(f"rank(s) {silent} did not answer (dead, or stuck past this check)")
    if waiting and stalled + silent:
        parts.append(f"rank(s) {waiting} were waiting for rank(s) {sorted(stalled + silent)} in a collective")
    elif waiting:
        parts.append(f"rank(s) {waiting} were all waiting inside a collective, none stalled outside one (the "
                     "collective itself did not complete: a GPU, a link or the communication library)")
    return (f"{what} did not finish within {limit_s:.0f} s: " + "; ".join(parts)
            + "; every thread's stack of each rank is in its log (logs/rank<N>.log in the reports folder); "
            + hint)
