"""One deadline for the whole `stackproof healthcheck`, so it ends before the scheduler kills it: slurmd kills a
HealthCheckProgram (and a Prolog under the usual PrologEpilogTimeout) at 60 s, and a health check killed mid-way
drains nothing and says nothing. The deadline is split by construction (act/config.py's settings):

  survey    the launcher's NVML survey, at most topology.SURVEY_DEADLINE_S
  ranks     validate's --run-timeout, cut to what is left for it
  stop      stopping the ranks after it: local_ranks.KILL_GRACE_S, then the bounded waits after SIGKILL
  act       --act-budget: the breaker's count and the drain; each call at most --act-timeout and at most what is
            left of the deadline, so act always has its time, however long validate took.
"""

from __future__ import annotations

import dataclasses
import time

from stackproof.measure.topology import SURVEY_DEADLINE_S
from stackproof.run.local_ranks import KILL_GRACE_S, KILL_WAIT_S

SLURMD_LIMIT_S = 60.0  # slurm.conf: a HealthCheckProgram not done in 60 s is killed
# After the ranks are told to stop: the grace, then SIGKILL's bounded waits (local_ranks: one after the stop,
# one more in its final sweep), and the verdict's own settling.
STOP_S = KILL_GRACE_S + 2 * KILL_WAIT_S + 1.0
SHORTEST_RANKS_S = 10.0  # less than this for the ranks proves nothing: a deadline leaving less is refused


def ranks_budget_s(deadline_s: float, act_budget_s: float) -> float:
    """What --run-timeout may be under this deadline, with act's time kept."""
    return deadline_s - SURVEY_DEADLINE_S - STOP_S - act_budget_s


def problem(deadline_s: float, act_budget_s: float) -> str | None:
    """Why this split cannot work, or None."""
    left = ranks_budget_s(deadline_s, act_budget_s)
    if left < SHORTEST_RANKS_S:
        return (f"--deadline {deadline_s:g} leaves the ranks {left:g} s after the NVML survey "
                f"({SURVEY_DEADLINE_S:g} s), stopping them ({STOP_S:g} s) and --act-budget {act_budget_s:g}: expected "
                f"at least {SHORTEST_RANKS_S:g} s; fix: raise --deadline (and the scheduler's limit with it) or lower "
                "--act-budget")
    return None


@dataclasses.dataclass
class Deadline:
    """The command's deadline, started when the command starts (time.monotonic)."""
    ends_at: float

    @classmethod
    def start(cls, total_s: float) -> Deadline:
        return cls(time.monotonic() + total_s)

    def left(self) -> float:
        return max(0.0, self.ends_at - time.monotonic())

    def call_timeout(self, per_call_s: float) -> float:
        """One scheduler call's timeout: --act-timeout, or what is left of the deadline if that is less (a call
        cut short fails and says so; a command killed by slurmd says nothing)."""
        return max(0.0, min(per_call_s, self.left()))


def fit(validate_settings, act_settings):
    """validate's settings with --run-timeout cut to what --deadline leaves the ranks (healthcheck, one line)."""
    budget = ranks_budget_s(act_settings.deadline, act_settings.act_budget)
    if validate_settings.run_timeout <= budget:
        return validate_settings
    timeout = min(validate_settings.timeout, budget)
    return dataclasses.replace(validate_settings, run_timeout=budget, timeout=timeout)
