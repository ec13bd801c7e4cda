"""NVML replayed for tests: tests/nvml_replay/pynvml.py, a pynvml that answers from a recording made on a real
GPU (tests/fixtures/nvml/), installed as `pynvml` for the test's duration."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

REPLAY = Path(__file__).parent / "nvml_replay" / "pynvml.py"
# The sysfs of the H200 VM the recordings were made on (PCI devices, NUMA nodes).
H200_SYSFS = str(Path(__file__).parent / "fixtures" / "sysfs" / "h200-vm")


def install_replay(monkeypatch, tmp_path: Path, recording: dict) -> ModuleType:
    """Write `recording` beside the test (each under a new name) and make the replaying pynvml answer from it."""
    path = tmp_path / f"recording{len(list(tmp_path.glob('recording*')))}.json"
    path.write_text(json.dumps(recording))
    monkeypatch.setenv("NVML_REPLAY", str(path))
    spec = importlib.util.spec_from_file_location("pynvml", REPLAY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def replayed_gpus(monkeypatch, tmp_path: Path, recording: dict) -> list:
    """The node's GPUs as topology.inventory reads them from the replayed recording."""
    from stackproof.measure import topology

    install_replay(monkeypatch, tmp_path, recording)
    return topology.inventory(H200_SYSFS).gpus
