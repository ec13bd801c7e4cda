"""Localization on this host's GPUs (two or more; skipped otherwise): the local pair matrix against NVML's links,
and the straggler check naming GPU 1 while a competing process hammers it with GEMMs.

    pytest tests/test_localize_gpu.py -k gpu
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu
RUN_TIMEOUT_S = 600
# The competitor: GEMMs back to back on one GPU for at most this long (it is stopped as soon as the run is done).
HAMMER_S = 300
HAMMER = f"""
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.mm(a, b); torch.cuda.synchronize()
print("hammering", flush=True)
end = time.monotonic() + {HAMMER_S}
while time.monotonic() < end:
    for _ in range(16):
        torch.mm(a, b)
    torch.cuda.synchronize()
"""


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def two_gpus() -> int:
    count = _gpus()
    if count < 2:
        pytest.skip(f"needs 2+ CUDA GPUs; this host has {count}")
    return count


def _validate(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("STACKPROOF_REPORTS", "PYTEST_ADDOPTS")}
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports), *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    path = reports / "report.json"
    return proc, json.loads(path.read_text()) if path.exists() else None


def test_gpu_local_pair_matrix_against_nvml_links(two_gpus, tmp_path):
    proc, report = _validate(tmp_path, "-k", "local_pairs")
    assert proc.returncode == 0 and report, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = report["tables"]["pairwise_local"]
    assert len(rows) == two_gpus * (two_gpus - 1) // 2
    for row in rows:
        assert row["gbps"] and row["gbps"] > 0 and row["link"].startswith(("NVLink", "PCIe")), row
        assert row["bar_gbps"] and row["gbps"] >= row["bar_gbps"], row
    header = re.search(r"^# +\(GB/s\)((?: +GPU \d+)+)$", proc.stdout, re.M)
    assert header and header.group(1).split() == [w for i in range(two_gpus) for w in ("GPU", str(i))], proc.stdout
    assert re.search(r"^  +GPU 1 +[0-9.]+ +-", proc.stdout, re.M), proc.stdout
    assert "each pair's NVML link peak" in proc.stdout
    print("\n".join(line for line in proc.stdout.splitlines() if "GPU" in line or "bar:" in line))


def test_gpu_straggler_is_named_while_another_process_loads_gpu_1(two_gpus, tmp_path):
    hammer = subprocess.Popen([sys.executable, "-c", HAMMER], env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = time.monotonic()
        line = hammer.stdout.readline()  # blocks until the competitor's first GEMM is done (or it died)
        assert "hammering" in line, f"the competing process did not start: {line}{hammer.stdout.read()[-2000:]}"
        assert time.monotonic() - started < 120
        proc, report = _validate(tmp_path, "-k", "stragglers")
    finally:
        hammer.kill()
        hammer.wait(timeout=30)
    assert proc.returncode == 1 and report, proc.stdout[-4000:]
    checks = {c["name"]: c for c in report["checks"]}
    gemm_phases = [f"stragglers::no_rank_arrives_late[{p}]" for p in ("all_reduce", "all_gather", "broadcast")]
    for name in gemm_phases:
        assert checks[name]["outcome"] == "failed" and checks[name]["failed_ranks"] == [1], checks[name]
        assert "cuda:1" in checks[name]["message"]
    assert all(0 not in c["failed_ranks"] for c in checks.values())
    assert report["ranks"][1]["gpu"]["index"] == 1  # rank 1 is GPU 1: report.json names it (UUID, serial, PCI)
    print("\n".join(line for line in proc.stdout.splitlines() if "stragglers::" in line))
