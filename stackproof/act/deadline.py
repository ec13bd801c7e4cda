"""One deadline for the whole `stackproof healthcheck`, so it ends before the scheduler kills it: slurmd kills a
HealthCheckProgram (and a Prolog under the usual PrologEpilogTimeout) at 60 s, and a health check killed mid-way
drains nothing and says nothing. The deadline is split by construction (act/config.py's settings):

  survey    the launcher's NVML survey (and --skip-busy-gpus' look), each at most topology.SURVEY_DEADLINE_S
  ranks     validate's --run-timeout, cut to what the deadline leaves once the survey is done: at least
            ranks_budget_s (a survey that took its whole time), more when it answered sooner. The per-check
            watchdog fires launch_env.VERDICT_S before the ranks are stopped, so a hang is named, not cut off.
  stop      stopping the ranks after it: local_ranks.KILL_GRACE_S, then the bounded waits after SIGKILL
  act       --act-budget: the breaker's count and the drain; each call at most --act-timeout and at most what is
            left of the deadline, so act always has its time, however long validate took.
"""

from __future__ import annotations

import dataclasses

from stackproof.measure.topology import SURVEY_DEADLINE_S
from stackproof.run.deadline import Deadline
from stackproof.run.launch_env import VERDICT_S
from stackproof.run.local_ranks import KILL_GRACE_S, KILL_WAIT_S

__all__ = ["Deadline", "fit", "problem", "ranks_budget_s", "ranks_most_s"]

SLURMD_LIMIT_S = 60.0  # slurm.conf: a HealthCheckProgram not done in 60 s is killed
START_AND_EXIT_S = 3.0  # the interpreter's start and exit around the healthcheck command, inside slurmd's limit
# After the ranks are told to stop: the grace, then SIGKILL's bounded waits (local_ranks: one after the stop,
# one more in its final sweep), and the verdict's own settling.
STOP_S = KILL_GRACE_S + 2 * KILL_WAIT_S + 1.0
SHORTEST_RANKS_S = 10.0  # less than this for the ranks proves nothing: a deadline leaving less is refused


def ranks_most_s(deadline_s: float, act_budget_s: float) -> float:
    """The most --run-timeout may be under this deadline (a survey that took no time), with act's time kept."""
    return deadline_s - STOP_S - act_budget_s


def ranks_budget_s(deadline_s: float, act_budget_s: float) -> float:
    """What the ranks get at least under this deadline: after a survey that took its whole time."""
    return ranks_most_s(deadline_s, act_budget_s) - SURVEY_DEADLINE_S


def problem(deadline_s: float, act_budget_s: float) -> str | None:
    """Why this split cannot work, or None: the ranks must have their shortest useful run, and the watchdog its
    VERDICT_S before they are stopped, even after a survey that took its whole time."""
    left = ranks_budget_s(deadline_s, act_budget_s)
    if left < SHORTEST_RANKS_S + VERDICT_S:
        return (f"--deadline {deadline_s:g} leaves the ranks {left:g} s after the NVML survey "
                f"({SURVEY_DEADLINE_S:g} s), stopping them ({STOP_S:g} s) and --act-budget {act_budget_s:g}: expected "
                f"at least {SHORTEST_RANKS_S + VERDICT_S:g} s ({SHORTEST_RANKS_S:g} s of checks, and the "
                f"{VERDICT_S:g} s the watchdog fires before the ranks are stopped so that a hung rank is named); fix: "
                "raise --deadline (and the scheduler's limit with it) or lower --act-budget")
    return None


def fit(validate_settings, act_settings):
    """validate's settings with --run-timeout cut to the most --deadline leaves the ranks (healthcheck; the launcher
    cuts it again to what the deadline leaves once the survey is done)."""
    budget = ranks_most_s(act_settings.deadline, act_settings.act_budget)
    if validate_settings.run_timeout <= budget:
        return validate_settings
    timeout = min(validate_settings.timeout, budget)
    return dataclasses.replace(validate_settings, run_timeout=budget, timeout=timeout)
