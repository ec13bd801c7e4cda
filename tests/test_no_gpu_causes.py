"""Exit 3 drains only where the GPUs are there and CUDA cannot reach them (issue 25, part 4): the cause is read at
the source (measure/cuda_reach.py) and judged (judge/reach.py). A CPU-only torch, a container without the NVIDIA
runtime, a driver/library mismatch, a driver too old for the image are configuration (alert) with their fix. The
judgement from readings; the launcher's real exit 3 on this GPU-less machine, and with a CPU-only torch first on
PYTHONPATH (a real process: the launcher reads torch's build, never imports it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stackproof.errors import Exit
from stackproof.judge import policy
from stackproof.judge import reach as rules
from stackproof.measure.cuda_reach import Reach

CPU_ONLY_TORCH = Path(__file__).parent / "fixtures" / "cpu_only_torch"
ON_A_GPU_NODE = dict(nvml_gpus=8, cuda_error=0, cuda_words="CUDA_SUCCESS", cuda_gpus=8, torch_version="2.11.0+cu130",
                     torch_cuda="13.0", device_files=tuple(f"/dev/nvidia{i}" for i in range(8)))


def cause(**reading):
    return rules.no_gpu(Reach(**{**ON_A_GPU_NODE, **reading}), 8, "8 NVIDIA GPU(s) on the PCI bus")


@pytest.mark.parametrize(("reading", "check"), [
    ({"torch_version": "2.11.0+cpu", "torch_cuda": None}, "torch's CUDA build"),
    ({"nvml_error": 12, "nvml_words": "NVML Shared Library Not Found", "nvml_gpus": None, "cuda_error": None,
      "cuda_words": "libcuda.so.1: cannot open shared object file"}, "NVIDIA runtime"),
    ({"nvml_error": 18, "nvml_words": "Driver/library version mismatch", "nvml_gpus": None}, "NVIDIA driver"),
    ({"cuda_error": 803, "cuda_words": "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"}, "NVIDIA driver"),
    ({"nvml_error": 9, "nvml_words": "Driver Not Loaded", "nvml_gpus": None}, "NVIDIA driver"),
    ({"nvml_gpus": 0}, "GPUs given to the container"),
    ({"cuda_error": None, "cuda_words": "libcuda.so.1: cannot open shared object file"}, "CUDA driver library"),
    ({"cuda_error": 35, "cuda_words": "CUDA_ERROR_INSUFFICIENT_DRIVER"}, "driver for the image's CUDA"),
    ({"cuda_error": 802, "cuda_words": "CUDA_ERROR_SYSTEM_NOT_READY"}, "NVSwitch fabric"),
    ({"cuda_error": 46, "cuda_words": "CUDA_ERROR_DEVICES_UNAVAILABLE"}, "GPUs free"),
    ({"cuda_error": 100, "cuda_words": "CUDA_ERROR_NO_DEVICE", "device_files": ()}, "GPU device files"),
    ({"cuda_visible_devices": "GPU-nonexistent"}, "GPUs visible to this process"),
])
def test_a_setup_that_hides_the_gpus_is_configuration_with_its_fix(reading, check):
    finding = cause(**reading)
    assert finding.check == check and finding.category == "configuration", finding
    assert policy.of(finding) == policy.ALERT and finding.action


@pytest.mark.parametrize("reading", [
    {"cuda_error": 100, "cuda_words": "CUDA_ERROR_NO_DEVICE"},  # the device files are there
    {"cuda_error": 999, "cuda_words": "CUDA_ERROR_UNKNOWN"},
    {"cuda_error": -1, "cuda_words": "cuInit did not return within 10 s"},
])
def test_gpus_nvml_counts_that_cuda_cannot_reach_drain(reading):
    finding = cause(**reading)
    assert (finding.check, finding.category, policy.of(finding)) == ("CUDA reaches the GPUs", "gpu-hardware",
                                                                     policy.DRAIN)
    assert "8 GPU(s) NVML counts" in finding.expected


def launch(tmp_path, *pythonpath: Path) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("NVIDIA_VISIBLE_DEVICES", "STACKPROOF_REPORTS")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--expect-gpus", "1", "--reports",
                           str(reports)], capture_output=True, text=True, timeout=120, env=env)
    return proc, json.loads((reports / "report.json").read_text())


def test_this_gpu_less_machine_is_a_missing_runtime_not_a_broken_node(tmp_path):
    proc, report = launch(tmp_path)
    assert proc.returncode == Exit.NO_GPU, proc.stdout
    (finding,) = report["findings"]
    assert (finding["check"], finding["category"]) == ("NVIDIA runtime", "configuration")
    assert "NVIDIA runtime: NVML: " in proc.stdout and "runtimeClassName nvidia" in proc.stdout


def test_a_cpu_only_torch_is_configuration(tmp_path):
    proc, report = launch(tmp_path, CPU_ONLY_TORCH)
    assert proc.returncode == Exit.NO_GPU, proc.stdout
    (finding,) = report["findings"]
    assert (finding["check"], finding["found"]) == ("torch's CUDA build", "torch 2.11.0+cpu is a CPU-only build")
