"""A deadline, started once and handed to every blocking call under it (the NVML looks, the ranks, each scheduler
call), each taking at most what is left: healthcheck's --deadline (act/deadline.py splits it)."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Deadline:
    """Ends at `ends_at` (time.monotonic)."""
    ends_at: float

    @classmethod
    def start(cls, total_s: float) -> Deadline:
        return cls(time.monotonic() + total_s)

    def left(self) -> float:
        return max(0.0, self.ends_at - time.monotonic())

    def call_timeout(self, per_call_s: float) -> float:
        """One call's timeout: its own limit, or what is left if that is less (a call cut short fails and says so;
        a command killed by the scheduler says nothing)."""
        return max(0.0, min(per_call_s, self.left()))

    def before(self, kept_s: float) -> Deadline:
        """The deadline `kept_s` earlier: what a step may use while the steps after it keep their time."""
        return Deadline(self.ends_at - kept_s)
