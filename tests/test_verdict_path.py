"""One verdict path, from each GPU's own findings to the scheduler (issue 24's cases): the decision from recorded
findings as the ranks stamp them, and real healthcheck processes whose faults come from outside the suite (a
replayed NVML answering GPU_IS_LOST, stackproof's own code broken on one rank, a read-only reports folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_judge_health import SYSFS, answer, recorded

from stackproof.act import decide
from stackproof.errors import ConfigError, Healthcheck
from stackproof.judge import exceptions, health, policy
from stackproof.judge.findings import Finding
from stackproof.report import folders, outputs
from stackproof.report.record import Check, Report, read_report

REPO = Path(__file__).resolve().parents[1]
TAKEN_OUT = int(Healthcheck.TAKEN_OUT)
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
REPLAY = Path(__file__).parent / "nvml_replay"
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"


def ranks_of(*nodes: str, per_node: int = 4) -> list[dict]:
    return [{"rank": r, "node": node, "host": node, "gpu": {"index": g, "uuid": f"GPU-{node}-{g}",
                                                             "pci_bus_id": f"0000:{0x19 + g:02x}:00.0"}}
            for r, (node, g) in enumerate((n, g) for n in nodes for g in range(per_node))]


def stamped(finding: Finding, rank: int, ranks: list[dict], source: str) -> Finding:
    gpu = ranks[rank]["gpu"]
    own = finding.gpu_index == gpu["index"]
    return finding.at(node=ranks[rank]["node"], rank=rank, source=source,
                      **({"uuid": gpu["uuid"], "pci_bus_id": gpu["pci_bus_id"]} if own else {}))


def record(ranks: list[dict], *failed: tuple[str, list[Finding]]) -> Report:
    checks = []
    for name, findings in failed:
        check = Check(f"smoke_tests/test_02_per_gpu.py::test_{name}", "failed",
                      failed_ranks=sorted({f.rank for f in findings}))
        check.findings = list(findings)
        checks.append(check)
    return Report(ranks=ranks, checks=checks, override=(1, "a check failed"), complete=True, started=time.time())


def test_a_leftover_process_on_rank_3s_gpu_alerts_rank_0s_class_does_not_count():
    ranks = ranks_of("n1")
    reading = health.HealthReading(processes=[health.Process(4242, "python", 100 << 30)],
                                   memory_used_bytes=100 << 30, memory_total_bytes=141 << 30)
    found = health.judge(3, "GPU-n1-3", True, reading, own_pids=set(), own_count=0)
    assert found and {f.category for f in found} == {"configuration"}
    (action,) = decide.decide(record(ranks, ("health_history", [stamped(f, 3, ranks, "per_gpu::health_history")
                                                                for f in found]))).to_act
    assert (action.node, action.action) == ("n1", policy.ALERT)
    assert "GPU 3 GPU-n1-3 PCI 0000:1c:00.0" in action.reason


def test_a_wrong_timed_gemm_on_rank_3_drains_though_rank_0_passed():
    ranks = ranks_of("n1")
    wrong = Finding(3, "", "bf16 GEMM 8192^3 (Freivalds)", "A@B within the bound", "2 wrong rows", "gpu-hardware",
                    "isolate", "drain")
    (action,) = decide.decide(record(ranks, ("gemm_throughput", [stamped(wrong, 3, ranks, "per_gpu::gemm")]))).to_act
    assert (action.node, action.action) == ("n1", policy.DRAIN)


def test_a_second_nodes_missing_nvlinks_drain_that_node_only():
    ranks = ranks_of("n1", "n2")
    down = Finding(1, "", "NVLink up", "18 links up", "12 up, 6 down", "interconnect", "reset", "reseat")
    # every rank of n2 reads its node's GPUs: the same finding four times counts once
    findings = [stamped(down, r, ranks, "gpus::gpus_have_what_they_should") for r in range(4, 8)]
    decision = decide.decide(record(ranks, ("gpus_have_what_they_should", findings)))
    assert {a.node: a.action for a in decision.actions} == {"n1": decide.PASS, "n2": policy.DRAIN}
    assert "(+" not in decision.drains[0].reason


def test_the_strongest_action_wins_not_the_strongest_severity():
    ranks = ranks_of("n1")
    ecc_off = Finding(0, "", "ECC", "enabled", "disabled", "configuration", "reset", "enable ECC")
    gsp = Finding(0, "", "XID 119", "no XID", "XID 119 (GSP RPC timeout)", "gpu-hardware", "reset", "reset")
    leftover = Finding(0, "", "other processes", "none", "pid 4242", "configuration", "isolate", "kill it")
    xid92 = Finding(0, "", "XID 92", "no XID", "XID 92 (high single-bit ECC rate)", "gpu-hardware", "triage", "watch")
    for pair in ((ecc_off, gsp), (leftover, xid92)):
        (action,) = decide.decide(record(ranks, ("health", [stamped(f, 0, ranks, "h") for f in pair]))).to_act
        assert action.action == policy.DRAIN and action.findings[0].category == "gpu-hardware"


@pytest.mark.parametrize(("type_name", "message", "category"), [
    ("KeyError", "'gpu'", "tool-error"),
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 80.00 GiB", "configuration"),
    ("AcceleratorError", "CUDA error: no kernel image is available for execution on the device", "software-pins"),
    ("AcceleratorError", "CUDA error: uncorrectable ECC error encountered", "gpu-hardware"),
    # issue 33: CUDA's and NCCL's own words for a hardware fault drain (before: tool errors, an alert)
    ("AcceleratorError", "CUDA error: uncorrectable NVLink error was detected during the execution", "interconnect"),
    ("AcceleratorError", "CUDA error: hardware stack error", "gpu-hardware"),
    ("AcceleratorError", "CUDA error: an illegal instruction was encountered", "gpu-hardware"),
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1935, unhandled cuda error (run with "
                         "NCCL_DEBUG=INFO for details), NCCL version 2.28.9", "gpu-hardware"),
])
def test_an_exception_takes_the_class_its_own_words_give_never_the_checks(type_name, message, category):
    assert exceptions.finding("per_gpu::gemm", type_name, message, "x.py:1").category == category
    drains = policy.of(exceptions.finding("c", type_name, message)) == policy.DRAIN
    assert drains == (category in ("gpu-hardware", "interconnect"))


def _healthcheck(tmp_path: Path, *args: str, reports: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM", "STACKPROOF_", "PET_", "CUDA_", "NVIDIA_", "PYTEST_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n2",
                           "--reports", str(reports or tmp_path / "reports"), *args],
                          env={**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)


def test_a_gpu_lost_at_pre_flight_takes_the_node_out(tmp_path):
    lost = recorded()
    answer(lost, "nvmlDeviceGetHandleByIndex", {"_error": 15}, [0], gpu=None)  # NVML_ERROR_GPU_IS_LOST
    (tmp_path / "recording.json").write_text(json.dumps(lost))
    proc = _healthcheck(tmp_path, "--pci-devices", SYSFS, NVML_REPLAY=str(tmp_path / "recording.json"),
                        PYTHONPATH=f"{REPLAY}:{REPO}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == TAKEN_OUT, out[-4000:]
    assert "# stackproof act: n2: drain: stackproof: GPU reachable GPU 0" in out, out[-4000:]
    assert "Traceback" not in out


ALLREDUCE = ["--expect-gpus", "0", "--nproc", "2", "--tier", "full", "-k", "all_reduce and sum-float32",
             "--max-check-bytes", "64K", "--timeout", "60"]


def test_stackproofs_own_error_on_one_rank_never_drains(tmp_path):
    """known_answers' input builder raises KeyError on rank 1 (patched from outside, by a pytest plugin)."""
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "own_bug.py").write_text(
        "import os\nfrom stackproof.measure import known_answers\n"
        "if os.environ.get('RANK') == '1':\n"
        "    def broken(*args, **kwargs):\n        raise KeyError('dtype')\n"
        "    known_answers.rank_input = broken\n")
    # rank 0 waits for rank 1's half of the collective: a short --timeout keeps the wait short
    proc = _healthcheck(tmp_path, *ALLREDUCE[:-1], "5", PYTHONPATH=f"{tmp_path / 'plugin'}:{REPO}",
                        PYTEST_PLUGINS="own_bug")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "n2: alert: stackproof: collectives::all_reduce[sum-float32]" in out, out[-4000:]
    record = json.loads((folders.current(tmp_path / "reports") / "report.json").read_text())  # its run's folder
    (check,) = record["checks"]
    assert "rank(s) [1]: KeyError: 'dtype'" in check["message"], check["message"]  # the table cuts it: rank 0's first
    assert {f["category"] for f in check["findings"]} == {"tool-error"}
    assert any("KeyError" in f["found"] and "(at own_bug.py:" in f["found"] for f in check["findings"])
    assert "this node stays in service; exit 0" in out


@pytest.fixture
def read_only(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)]).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_reports_folder_still_takes_a_faulty_node_out(tmp_path, read_only):
    proc = _healthcheck(tmp_path, *ONE_RANK, reports=read_only,
                        PYTHONPATH=f"{BROKEN_ALLREDUCE}:{REPO}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == TAKEN_OUT, out[-4000:]
    assert "the reports folder could not be written (not writable by this user (0): Read-only file system): " \
           "this run's report is in" in out, out[-4000:]
    assert "n2: drain: stackproof: collectives::all_reduce[sum-float32]" in out


def test_act_refuses_a_report_of_the_previous_schema_with_the_fix(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"schema": "stackproof.report/1", "exit_code": 1}))
    proc = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(tmp_path), "--scheduler", "none"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "field 'schema': expected 'stackproof.report/2', found 'stackproof.report/1'; fix:" in line


ONE_RANK = [*ALLREDUCE[:3], "1", *ALLREDUCE[4:]]


def test_one_name_for_this_node_the_flag_wins_over_the_setting(tmp_path):
    proc = _healthcheck(tmp_path, *ONE_RANK, PYTHONPATH=f"{BROKEN_ALLREDUCE}:{REPO}", STACKPROOF_NODE_NAME="foo")
    out = proc.stdout + proc.stderr
    assert proc.returncode == TAKEN_OUT, out[-4000:]
    assert f"would be taken (--scheduler none) out of service (n2); exit {TAKEN_OUT}" in out, out[-4000:]
    assert "(foo)" not in out


def test_a_dry_run_keeps_the_breaker(tmp_path):
    proc = _healthcheck(tmp_path, *ONE_RANK, "--max-drained", "0", PYTHONPATH=f"{BROKEN_ALLREDUCE}:{REPO}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "this node stays in service (drain withheld: 0 of 1 nodes already out of service" in out, out[-4000:]


def test_an_injected_fault_is_never_acted_on(tmp_path):
    proc = _healthcheck(tmp_path, *ONE_RANK, "--inject-fault", "allreduce-add-one", "--fault-rank", "0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "not acted on: the run injected a fault on purpose (--inject-fault allreduce-add-one)" in out


@pytest.mark.parametrize("argv", [["--tier", "bogus"], ["--scheduler", "bogus"], ["--expect-gpus", "abc"],
                                  ["--no-such-flag"], ["--nproc", "0"], ["--tier", "burn", "--deadline", "5"]])
def test_flags_refused_are_bad_input_the_node_stays_and_the_metric_says_not_judged(tmp_path, argv):
    """Issue 36 item 5: bad flags set stackproof_healthcheck_broken to 0 although nothing was judged (or said
    "repair the install" for a flag)."""
    proc = subprocess.run([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--reports",
                           str(tmp_path), *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not run (bad input); this node stays in service; exit 0" in proc.stdout
    assert "fix: correct the flag or setting the line above names (the install is fine)" in proc.stderr
    assert "repair the install" not in proc.stderr
    metric = (tmp_path / "stackproof-healthcheck.prom").read_text()
    assert 'stackproof_healthcheck_broken{reason="bad input"} 1' in metric


def test_the_pci_devices_given_are_the_evidence_for_exit_3(tmp_path):
    """A CPU host told its bus is an H200 VM's (sysfs fixture): the bus given sets what is expected; with no NVIDIA
    runtime here (no NVML, no libcuda) that is the runtime's to fix (issue 25: an alert, not a drain)."""
    proc = _healthcheck(tmp_path, "--pci-devices", SYSFS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "GPUs were expected (1 NVIDIA GPU(s) on the PCI bus (0000:00:06.0))" in out, out[-4000:]
    assert "n2: alert: stackproof: NVIDIA runtime" in out
    lines = [line for line in proc.stdout.splitlines() if line.startswith("# Verdict:") or line.startswith("# report:")]
    assert lines[0].startswith("# Verdict:") and lines[1].startswith("# report:")  # the verdict, then the path


WRONG_SHAPES = ["[]", "null", '{"schema": "stackproof.report/2", "nodes": "vm"}',
                '{"schema": "stackproof.report/2", "exit_code": 1, "settings": {}, "ranks": [], '
                '"nodes": [{"ranks": []}], "checks": [], "findings": []}']


@pytest.mark.parametrize("text", WRONG_SHAPES)
def test_the_one_door_refuses_a_report_of_the_wrong_shape_with_the_fix(tmp_path, text):
    (tmp_path / "report.json").write_text(text)
    with pytest.raises(ConfigError, match="; fix: "):
        read_report(tmp_path)


@pytest.mark.parametrize("command", [["act", "--scheduler", "none", "--reports"], ["spec", "-o", "spec.json"],
                                     ["report", "-o", "page.html"]])
def test_act_spec_and_report_go_through_the_door(tmp_path, command):
    (tmp_path / "report.json").write_text(WRONG_SHAPES[2])
    proc = subprocess.run([PYTHON, "-m", "stackproof", *command, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "field 'exit_code'" in proc.stderr and "; fix: " in proc.stderr


def test_act_on_a_node_the_report_does_not_have_lists_its_nodes(tmp_path):
    ranks = ranks_of("n1", per_node=1)
    outputs.write(Report(ranks=ranks, override=(0, "ok"), complete=True), tmp_path)
    proc = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(tmp_path), "--scheduler", "none",
                           "--node", "typo"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert "--node typo: expected a node of the run" in proc.stderr and "found only n1" in proc.stderr


def test_verdict_on_a_report_of_another_schema_is_exit_2(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"schema": "stackproof.report/1", "exit_code": 0}))
    proc = subprocess.run([PYTHON, "-m", "stackproof", "verdict", "--reports", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "expected 'stackproof.report/2', found 'stackproof.report/1'; fix:" in proc.stderr


def test_healthchecks_plan_is_a_pure_function_of_flags_environment_bus_and_gpu_use():
    from stackproof.act.config import ActConfig
    from stackproof.act.hardware import GpuUse
    from stackproof.act.run import plan
    from stackproof.run.config import ValidateConfig

    bus = ["0000:19:00.0", "0000:3b:00.0"]
    named = plan(ValidateConfig(), ActConfig(scheduler="none", node="bar"), {"STACKPROOF_NODE_NAME": "foo"}, bus)
    assert named.node == "bar" and named.validate.node_name == "bar"
    assert plan(ValidateConfig(), ActConfig(scheduler="none"), {"SLURMD_NODENAME": "n7"}, bus).node == "n7"
    use = [GpuUse(0, "GPU-a", (4242,)), GpuUse(1, "GPU-b", ())]
    busy = plan(ValidateConfig(), ActConfig(scheduler="none", skip_busy_gpus=True), {}, bus, use)
    assert (busy.validate.visible_devices, busy.validate.expect_gpus) == ("GPU-b", 1)
    assert any("GPU 0 GPU-a (pid 4242)" in line for line in busy.said)
    idle = plan(ValidateConfig(), ActConfig(scheduler="none", skip_busy_gpus=True), {}, bus,
                [GpuUse(0, "GPU-a", ()), GpuUse(1, "GPU-b", ())])
    assert (idle.validate.visible_devices, idle.validate.expect_gpus) == (None, None)  # the bus says, as ever
    everything = plan(ValidateConfig(), ActConfig(scheduler="none", skip_busy_gpus=True), {}, bus,
                      [GpuUse(0, "GPU-a", (1,)), GpuUse(1, "GPU-b", (2,))])
    assert everything.nothing_to_check
    unread = plan(ValidateConfig(), ActConfig(scheduler="none", skip_busy_gpus=True), {}, bus, "NVML cannot answer")
    assert unread.said == ("--skip-busy-gpus: NVML cannot answer; no GPU skipped",)


def test_a_scheduler_node_name_that_is_no_name_is_blamed_on_its_variable(tmp_path):
    """Issue 36 item 13: SLURMD_NODENAME='bad name' was blamed on --node-name, a flag nobody gave."""
    proc = subprocess.run([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--reports",
                           str(tmp_path), "-k", "barrier"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), "SLURMD_NODENAME": "bad name"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stackproof: SLURMD_NODENAME='bad name': expected a node name" in proc.stderr, proc.stderr
    assert "--node-name" not in proc.stderr and "fix: pass --node NAME" in proc.stderr
