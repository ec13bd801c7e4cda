"""When this process passed each step of a run's start-up (epoch seconds), for report.json's context["phases"]:
the launcher's start, each rank's own start, its torch import, CUDA init and process group, then the checks.
benchmarks/startup.py prints them. Torch-free: the launcher records its start here too."""

from __future__ import annotations

import os
import time

# Each rank's steps, in order; rank 0 adds the run's own (checks_started, checks_done), and stackproof's launcher
# when its ranks had all said they leave, their records complete (ranks_done), and when they had all exited
# (ranks_exited: the kernel's and the driver's teardown of each process included).
RANK_PHASES = ("rank_started", "torch_imported", "cuda_ready", "process_group_ready")
RUN_PHASES = ("checks_started", "checks_done", "ranks_done", "ranks_exited")

_marks: dict[str, float] = {}


def process_started() -> float:
    """When this process began (the kernel's record, so the interpreter's own start counts), or now."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: starttime, clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def mark(name: str) -> None:
    """The first time this process reached `name`."""
    _marks.setdefault(name, time.time())


def reset() -> None:
    """A process forked from one that marked already (run/warm.py): its own steps start here."""
    _marks.clear()


def so_far() -> dict[str, float]:
    return {"rank_started": process_started(), **_marks}
