"""Run: start the ranks (launcher, local_ranks, agent, worker), the pytest plugin that turns one session per rank
into one record (plugin, dist, consensus, watchdog), the run's settings (config) and its reports folder (settle).
The checks themselves are smoke_tests/; what they read and time is stackproof/measure/."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def smoke_tests_dir() -> Path:
    """The suite: installed as the package data `stackproof.smoke_tests` (pip install .), or beside the package in
    a checkout and in the images (/opt/stackproof/smoke_tests)."""
    spec = importlib.util.find_spec("stackproof.smoke_tests")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return (Path(__file__).resolve().parents[2] / "smoke_tests").resolve()
