"""`stackproof validate` itself on a node whose GPU NVML cannot reach, or whose PCI bus shows more GPUs than NVML:
the fake pynvml (tests/nvml_replay) answers from the H200 recording with one reading altered, beneath the real
launcher process. Each run ends before any rank starts: a finding on the GPU, report.json written, the exit code
of the contract, and never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from test_judge_health import RECORDING, SYSFS, answer, recorded

from stackproof.errors import Exit

REPO = Path(__file__).resolve().parent.parent
REPLAY_DIR = Path(__file__).parent / "nvml_replay"
TIMEOUT_S = 120


def validate(tmp_path: Path, recording: dict, pci_devices: str, *args: str):
    (tmp_path / "recording.json").write_text(json.dumps(recording))
    env = {k: v for k, v in os.environ.items() if k not in (
        "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "STACKPROOF_REPORTS", "PYTEST_ADDOPTS")}
    env.update(NVML_REPLAY=str(tmp_path / "recording.json"),
               PYTHONPATH=os.pathsep.join([str(REPLAY_DIR), str(REPO), env.get("PYTHONPATH", "")]))
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports),
                           "--pci-devices", pci_devices, *args], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)
    report = json.loads((reports / "report.json").read_text()) if (reports / "report.json").exists() else None
    return proc, report


def test_a_gpu_answering_unknown_error_is_a_finding_with_a_report(tmp_path):
    lost = recorded()
    answer(lost, "nvmlDeviceGetHandleByIndex", {"_error": 999}, [0], gpu=None)  # NVML_ERROR_UNKNOWN
    proc, report = validate(tmp_path, lost, SYSFS)
    assert proc.returncode == Exit.FAILED, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    finding = report["findings"][0]
    assert (finding["gpu_index"], finding["check"]) == (0, "GPU reachable")
    assert finding["found"] == "n/a: NVML error Unknown Error"
    assert (finding["category"], finding["severity"]) == ("gpu-hardware", "isolate")
    assert report["exit_code"] == Exit.FAILED and "GPU 0" in report["message"]


def test_a_gpu_on_the_bus_that_nvml_does_not_show_is_named(tmp_path):
    bus = tmp_path / "sysfs"
    shutil.copytree(SYSFS, bus)
    shutil.copytree(bus / "0000:00:06.0", bus / "0000:00:07.0")  # a second H200 that fell off the bus
    proc, report = validate(tmp_path, recorded(), str(bus))
    assert proc.returncode == Exit.FAILED, proc.stdout + proc.stderr
    [finding] = report["findings"]
    assert finding["expected"] == "the GPU at PCI 0000:00:07.0 visible to NVML"
    assert "2 NVIDIA GPU(s) on the PCI bus" in report["context"]["expected_gpus"]
    assert "0000:00:07.0" in proc.stdout


def test_a_dead_driver_on_a_node_with_gpus_on_the_bus_is_no_gpu(tmp_path):
    """NVML cannot start (no driver loaded): the bus still shows the H200, so the node must not pass on CPU."""
    dead = recorded()
    answer(dead, "nvmlInit", {"_error": 9}, gpu=None)  # NVML_ERROR_DRIVER_NOT_LOADED
    proc, report = validate(tmp_path, dead, SYSFS)
    assert proc.returncode == Exit.NO_GPU, proc.stdout + proc.stderr
    assert "1 NVIDIA GPU(s) on the PCI bus (0000:00:06.0)" in report["message"]
    assert RECORDING["devices"][0]["nvmlDeviceGetName"]["[]"] == "NVIDIA H200"
