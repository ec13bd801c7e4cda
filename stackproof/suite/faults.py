"""Faults injected on purpose (--inject-fault) to prove the suite turns red when a rank goes wrong."""

from __future__ import annotations

import os
import time

from stackproof.suite.config import ValidateConfig


def active(settings: ValidateConfig, fault: str, rank: int) -> bool:
    return settings.inject_fault == fault and rank == settings.fault_rank


def stop_if_asked(settings: ValidateConfig, rank: int) -> None:
    """A rank that stops answering (hang) or dies (crash): the others must not wait forever, and the run's
    error must name it."""
    if active(settings, "hang", rank):
        time.sleep(settings.run_timeout * 2)
    if active(settings, "crash", rank):
        os._exit(13)
