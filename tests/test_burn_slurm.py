"""scripts/slurm/burn-in.sbatch submitted for real, on a Slurm cluster of its own (scripts/ci/slurm-cluster.sh
under another name and ports), as root, CPU ranks and a 5 s soak: a new node held by its maintenance reservation
passes and is released; a node whose GEMMs go wrong after 2 s of load (tests/fault_plugins/burn_faults.py, from
outside the suite) is drained with the check in its reason, and keeps no hold it did not have."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stackproof.errors import Healthcheck

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
CLUSTER = REPO / "scripts" / "ci" / "slurm-cluster.sh"
BURN_IN = REPO / "scripts" / "slurm" / "burn-in.sbatch"
PLUGINS = REPO / "tests" / "fault_plugins"
CONF = "/etc/slurm-burn/slurm.conf"
JOB_S = 240


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STACKPROOF_", "PYTEST_"))},
            "SLURM_CONF": CONF, "SLURM_CLUSTER_NAME": "stackproof-burn", "SLURM_CLUSTER_PORT_BASE": "7117"}


def _slurm(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=_env(), check=check)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        if os.environ.get("STACKPROOF_REQUIRE_SLURM") == "1":
            pytest.fail("STACKPROOF_REQUIRE_SLURM=1 but the burn-in job's cluster needs root")
        pytest.skip("the burn-in job's cluster needs root (scripts/ci/slurm-cluster.sh)")
    up = subprocess.run(["bash", str(CLUSTER)], capture_output=True, text=True, timeout=600,
                        env={**_env(), "SLURM_CLUSTER_WAIT_S": "90"})
    assert up.returncode == 0, up.stderr[-3000:]
    yield
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120, env=_env())


def _submit(tmp_path: Path, node: str, *sbatch: str, **env: str) -> subprocess.Popen:
    settings = {"STACKPROOF_PYTHON": PYTHON, "STACKPROOF_REPO": str(REPO), "STACKPROOF_BURN_SECONDS": "5",
                "STACKPROOF_BURN_REPORTS": str(tmp_path / "burn-in"), "STACKPROOF_HEALTHCHECK_CONF": "/nonexistent",
                "STACKPROOF_HEALTHCHECK_REPORTS": str(tmp_path / "healthcheck"), "OMP_NUM_THREADS": "1",
                "STACKPROOF_HEALTHCHECK_ARGS": "--expect-gpus 0 --nproc 1 -k burn"}
    return subprocess.Popen(["sbatch", "--wait", f"--nodelist={node}", "--nodes=1", "--partition=debug",
                             f"--output={tmp_path}/{node}-%j.out", *sbatch, str(BURN_IN)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_env(), **settings, **env})


def test_a_held_node_that_passes_is_released_and_a_failing_one_is_drained(cluster, tmp_path):
    tmp_path.chmod(0o755)
    _slurm("scontrol", "delete", "reservation=stackproof-burn-in-n1", check=False)
    for node in ("n1", "n2"):
        _slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    _slurm("scontrol", "create", "reservation", "reservationname=stackproof-burn-in-n1", "nodes=n1", "users=root",
           "starttime=now", "duration=infinite", "flags=maint,ignore_jobs")
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "injected_burn.py").write_text(
        "from burn_faults import install, pytest_runtest_setup  # noqa: F401\n"
        "install(['gemm-wrong-after'], rank=0, after_s=2)\n")
    try:
        held = _submit(tmp_path, "n1", "--reservation=stackproof-burn-in-n1")
        broken = _submit(tmp_path, "n2", PYTHONPATH=f"{tmp_path / 'plugin'}:{PLUGINS}",
                         PYTEST_PLUGINS="injected_burn")
        held_out, _ = held.communicate(timeout=JOB_S)
        broken_out, _ = broken.communicate(timeout=JOB_S)
        logs = {p.name: p.read_text() for p in tmp_path.glob("n*-*.out")}
        assert held.returncode == 0, (held_out, logs)
        n1 = next(text for name, text in logs.items() if name.startswith("n1-"))
        assert "n1 passed; releasing its hold: scontrol update reservationname=stackproof-burn-in-n1 endtime=now" \
            in n1, n1
        released = _slurm("srun", "--nodelist=n1", "--nodes=1", "--immediate=20", "--time=1", "true", check=False)
        assert released.returncode == 0, released.stderr  # a job outside the reservation runs there now
        assert broken.returncode != 0, (broken_out, logs)
        n2 = next(text for name, text in logs.items() if name.startswith("n2-"))
        assert f"this node taken out of service (n2); exit {int(Healthcheck.TAKEN_OUT)}" in n2, n2
        assert "n2 did not pass" in n2, n2
        reasons = _slurm("sinfo", "--Node", "--noheader", "--format=%N|%E").stdout
        assert "n2|stackproof: burn::gemms_give_known_answers_throughout" in reasons, reasons
        assert "n1|none" in reasons, reasons
    finally:
        _slurm("scontrol", "delete", "reservation=stackproof-burn-in-n1", check=False)
        _slurm("scontrol", "update", "nodename=n2", "state=resume", check=False)
