"""`stackproof healthcheck` on this host (CPU ranks), with faults from outside the suite, and the scheduler's
contract: exit TAKEN_OUT (errors.Healthcheck) only when the node is taken out of service (here --scheduler none:
would be), else 0.

- started as a rank of someone else's job (RANK, WORLD_SIZE, SLURM_PROCID ... set, as under srun or in a Prolog),
  with torch's all_reduce broken underneath (tests/fixtures/broken_allreduce on PYTHONPATH): it launches its own
  ranks, the hardware-classified check fails, and the node would be drained (exit TAKEN_OUT);
- the scheduler allocated GPUs (SLURM_GPUS_ON_NODE), none is visible and no NVIDIA runtime is here: an alert, exit 0;
- bad input: nothing ran, the node stays in service (exit 0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from stackproof.errors import Healthcheck

TAKEN_OUT = int(Healthcheck.TAKEN_OUT)
REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
ALLREDUCE = ["--expect-gpus", "0", "--nproc", "1", "--tier", "full", "-k", "all_reduce and sum-float32",
             "--max-check-bytes", "64K", "--timeout", "60"]


def _healthcheck(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM", "STACKPROOF_", "PET_", "CUDA_", "NVIDIA_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n2",
                           "--reports", str(tmp_path / "reports"), *args],
                          env={**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)


def test_started_as_a_rank_it_launches_its_own_and_a_broken_all_reduce_takes_the_node_out(tmp_path):
    proc = _healthcheck(tmp_path, *ALLREDUCE, PYTHONPATH=f"{BROKEN_ALLREDUCE}:{REPO}", RANK="3", WORLD_SIZE="8",
                        LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29999", SLURM_PROCID="3",
                        SLURM_NTASKS="8")
    out = proc.stdout + proc.stderr
    assert proc.returncode == TAKEN_OUT, out[-4000:]
    assert "runs as this node's launcher, not as a rank: ignoring RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, " \
           "MASTER_PORT, SLURM_PROCID, SLURM_NTASKS" in out, out[-4000:]
    assert "collectives::all_reduce[sum-float32]  FAIL" in out, out[-4000:]
    assert re.search(r"\(index \d+: 1\.0\), found index \d+: 2\.0", out), out[-4000:]
    assert "# stackproof act: n2: drain: stackproof: collectives::all_reduce[sum-float32] rank 0" in out
    assert f"this node would be taken (--scheduler none) out of service (n2); exit {TAKEN_OUT}" in out


def test_without_the_broken_library_the_same_run_stays_in_service(tmp_path):
    proc = _healthcheck(tmp_path, *ALLREDUCE, RANK="3", WORLD_SIZE="8")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "validate exit 0 (every check ran and passed); this node stays in service; exit 0" in proc.stdout


def test_gpus_the_scheduler_allocated_without_the_nvidia_runtime_alert_and_stay(tmp_path):
    """The scheduler allocated GPUs and none is visible, but NVML and libcuda are not here at all: the runtime's to
    fix (an alert with its fix), not a node to drain (judge/reach.py)."""
    proc = _healthcheck(tmp_path, "--tier", "fast", SLURM_GPUS_ON_NODE="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "# stackproof act: n2: alert: stackproof: NVIDIA runtime" in out, out[-4000:]
    assert "validate exit 3" in out and "this node stays in service; exit 0" in out


def test_bad_input_keeps_the_node_in_service(tmp_path):
    proc = _healthcheck(tmp_path, "--expect-gpus", "-1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--expect-gpus" in proc.stdout + proc.stderr and "this node stays in service; exit 0" in proc.stdout


def test_the_tools_own_failure_keeps_the_node_in_service(tmp_path):
    """A reports folder that cannot be written (a full or read-only disk, as a Prolog meets it): exit 0."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    proc = _healthcheck(tmp_path, "--tier", "fast", "--expect-gpus", "0", "--reports", str(blocked / "reports"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "this node stays in service; exit 0" in proc.stdout, proc.stdout + proc.stderr


def test_two_healthchecks_started_together_one_judges_the_other_says_a_check_is_running(tmp_path):
    """The hourly check and a job's Prolog on one node at once (issue 33): one holds the node's reports folder for
    the whole command and judges; the other judges nothing and drains nothing (exit 0: only a node taken out is
    86). Before, with --keep-runs each took a lock on its own run folder only, and both ran their ranks at once."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM", "STACKPROOF_", "PET_", "CUDA_", "NVIDIA_", "PYTEST_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    argv = [PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n2", "--reports",
            str(tmp_path / "reports"), "--keep-runs", "5", "--expect-gpus", "0", "--nproc", "2", "--tier", "full",
            "-k", "dev_shm", "--deadline", "300"]  # a deadline no loaded CI host misses
    env = {**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    judged = [out for out in outs if "validate exit 0 (every check ran and passed)" in out]
    refused = [out for out in outs if "another healthcheck is checking this node (pid " in out]
    assert len(judged) == 1 and len(refused) == 1, outs
    assert "validate not run (a check is already running); this node stays in service; exit 0" in refused[0]
    assert "stackproof validate:" not in refused[0]  # no rank of its own was started
    assert len(list((tmp_path / "reports" / "runs").iterdir())) == 1, outs
