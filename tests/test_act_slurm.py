"""scripts/slurm/healthcheck.sh on the real two-node cluster (scripts/ci/slurm-cluster.sh): run on n2 through srun,
as root, with SLURMD_NODENAME and SLURM_JOB_ID set as a Prolog has them, CPU ranks (--expect-gpus 0).

A fault on n2 drains n2 with its reason in `sinfo -R`, n1 stays up, `scontrol update state=resume` brings n2
back; a passing run, bad input (exit 2) and the tool's own timeout (exit 4) drain nothing. The cluster is shared:
every node drained here is resumed in the fixture's teardown, and the drained window is a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from test_launchers_slurm import PYTHON, REPO, _rank_env, slurm_cluster  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slurm

HEALTHCHECK = REPO / "scripts" / "slurm" / "healthcheck.sh"
STEP_TIMEOUT_S = 180
# Exact collective checks only, small buffers: a fault there fails rank 1 of this node's 2 CPU ranks.
ALLREDUCE = ("--expect-gpus", "0", "--tier", "full", "-k", "all_reduce and sum-float32", "--max-check-bytes", "64K")


def _sinfo_states() -> dict[str, str]:
    out = subprocess.run(["sinfo", "--Node", "--noheader", "--format=%N %t"], capture_output=True, text=True,
                         timeout=20, check=True).stdout
    return dict(line.split()[:2] for line in out.splitlines() if line.strip())


def _reasons() -> dict[str, str]:
    """`sinfo -R`: node -> reason, for every drained, draining or down node."""
    out = subprocess.run(["sinfo", "-R", "--noheader", "--format=%N|%E"], capture_output=True, text=True,
                         timeout=20, check=True).stdout
    reasons = {}
    for line in out.splitlines():
        nodes, _, reason = line.partition("|")
        for node in subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                   timeout=20).stdout.split():
            reasons[node] = reason.strip()
    return reasons


def _resume(node: str) -> None:
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, text=True,
                   timeout=20)


@pytest.fixture
def drained_by_us(slurm_cluster):  # noqa: F811
    """Nodes this test drained get resumed, whatever happens (the cluster is shared)."""
    before = {n for n, r in _reasons().items()}
    yield
    for node, reason in _reasons().items():
        if node not in before and reason.startswith("stackproof:"):
            _resume(node)


def _healthcheck(tmp_path: Path, node: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """srun the health check on `node` (one task, as root); (the step, that node's reports folder)."""
    cmd = ["srun", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--time=4", f"--chdir={REPO}",
           "bash", str(HEALTHCHECK), *args]
    env = _rank_env(STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, cwd=REPO, env=env)
    return proc, tmp_path / node


def _last_exit(reports: Path) -> int:
    """validate's exit code, as healthcheck.sh logged it."""
    lines = [line for line in (reports / "healthcheck.log").read_text().splitlines() if line.startswith("# exit ")]
    return int(lines[-1].split()[-1])


def test_a_fault_on_n2_drains_n2_only_and_resume_brings_it_back(tmp_path, drained_by_us):
    started = time.monotonic()
    proc, reports = _healthcheck(tmp_path, "n2", *ALLREDUCE, "--inject-fault", "allreduce-add-one")
    step_s, step_ended = time.monotonic() - started, time.monotonic()
    output = proc.stdout + proc.stderr
    # In a Prolog (SLURM_JOB_ID set) a node just drained exits 1, so the job does not start there.
    assert proc.returncode == 1, output[-4000:]
    assert _last_exit(reports) == 1
    report = json.loads((reports / "report.json").read_text())
    assert [n["node"] for n in report["nodes"]] == ["n2"] and report["nodes"][0]["verdict"] == "FAIL"
    reason = "stackproof: collectives::all_reduce[sum-float32] rank 1"
    assert f"# stackproof act: run: scontrol update nodename=n2 state=drain 'reason={reason}'" in output

    reasons, states = _reasons(), _sinfo_states()
    try:
        assert reasons.get("n2") == reason, reasons
        assert states["n2"].rstrip("*~#") in ("drain", "drng"), states
        assert "n1" not in reasons and states["n1"].rstrip("*~#") in ("idle", "mix", "alloc"), states
    finally:
        _resume("n2")
    # n2 is drained from the end of the checks (within the step) until this resume.
    print(f"healthcheck step on n2: {step_s:.1f} s; resumed {time.monotonic() - step_ended:.1f} s after it ended")
    deadline = time.monotonic() + 30
    while _sinfo_states()["n2"].rstrip("*~#") not in ("idle", "mix", "alloc"):
        assert time.monotonic() < deadline, f"n2 not back after resume: {_sinfo_states()}"
        time.sleep(0.5)
    assert "n2" not in _reasons()


@pytest.mark.parametrize(("case", "args", "code"), [
    ("passes", ALLREDUCE, 0),
    ("bad input", (*ALLREDUCE, "--expect-gpus", "-1"), 2),
    # The tool's own limit: a rank that hangs makes the run incomplete (exit 4), which proves nothing about n2.
    ("tool timeout", ("--expect-gpus", "0", "--tier", "full", "-k", "barrier", "--inject-fault", "hang",
                      "--timeout", "5", "--check-timeout", "4", "--run-timeout", "30"), 4),
])
def test_outcomes_other_than_a_failed_check_drain_nothing(tmp_path, drained_by_us, case, args, code):
    proc, reports = _healthcheck(tmp_path, "n2", *args)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{case}: {output[-4000:]}"
    assert _last_exit(reports) == code, output[-4000:]
    assert "run: scontrol" not in output
    if code:
        assert "# stackproof act: not acted on: exit code " + str(code) in output, output[-3000:]
    else:
        assert "# stackproof act: every node passed: nothing to act on" in output
    assert not {n: r for n, r in _reasons().items() if r.startswith("stackproof:")}, _reasons()


def test_a_run_without_a_job_acts_as_health_check_program(tmp_path, drained_by_us):
    """HealthCheckProgram: root, no job, no srun; the node's name from the environment slurmd gives it."""
    env = {**_rank_env(STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path), PYTHONPATH=str(REPO)), "SLURMD_NODENAME": "n2"}
    proc = subprocess.run(["bash", str(HEALTHCHECK), *ALLREDUCE], capture_output=True, text=True,
                          timeout=STEP_TIMEOUT_S, cwd="/", env=env)
    assert proc.returncode == 0 and _last_exit(tmp_path / "n2") == 0, proc.stdout[-3000:]
    assert os.stat(tmp_path / "n2" / "report.json").st_size > 0
    assert "n2" not in _reasons()


def test_act_on_a_two_node_run_drains_the_failed_node_only(tmp_path, drained_by_us):
    """`stackproof act` after a real job over n1 and n2 whose rank 1 (on n2) failed: n2 is drained, n1 is not."""
    reports = tmp_path / "reports"
    cmd = ["srun", "--nodes=2", "--ntasks-per-node=1", "--time=5", "--kill-on-bad-exit=0", f"--chdir={REPO}",
           PYTHON, "-m", "stackproof", "validate", "--reports", str(reports), *ALLREDUCE,
           "--inject-fault", "allreduce-add-one"]
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, cwd=REPO,
                         env=_rank_env(PYTHONPATH=str(REPO)))
    assert job.returncode == 1, (job.stdout + job.stderr)[-4000:]
    act = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(reports), "--scheduler", "slurm"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=_rank_env(PYTHONPATH=str(REPO)))
    try:
        assert act.returncode == 0, act.stdout + act.stderr
        assert "# stackproof act: failed node(s): n2" in act.stdout
        reasons = _reasons()
        assert reasons.get("n2") == "stackproof: collectives::all_reduce[sum-float32] rank 1", reasons
        assert "n1" not in reasons
    finally:
        _resume("n2")
