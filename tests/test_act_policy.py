"""The policy table, the circuit breaker's arithmetic and the decision's special cases, without a scheduler or a GPU:
pure functions of recorded reports. The real runs that feed them are in test_act_kubernetes.py (a fault on one of
two "nodes"), test_act_healthcheck.py (faults from outside the suite) and test_act_slurm.py (slurmd itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.act import breaker, decide, hardware, kubernetes, slurm
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.judge import expectation, hang, policy
from stackproof.judge import hardware as jhardware
from stackproof.judge.findings import CATEGORIES, SEVERITIES, Finding
from stackproof.measure import topology
from stackproof.report.record import Check, Report

REPO = Path(__file__).resolve().parents[1]


def test_the_table_covers_every_category_and_severity_and_docs_print_it():
    assert set(policy.TABLE) == {(c, s) for c in CATEGORIES for s in SEVERITIES}
    assert set(policy.TABLE.values()) <= set(policy.ACTIONS)
    assert policy.markdown() in (REPO / "docs" / "act.md").read_text()


def test_only_the_machines_own_faults_drain():
    for (category, severity), action in policy.TABLE.items():
        if category in ("software-pins", "configuration"):
            assert action == policy.ALERT, (category, severity)
    assert policy.action("gpu-hardware", "isolate") == policy.DRAIN
    assert policy.action("", "") == policy.ALERT  # an unclassified failure never drains
    lost = expectation.gpus_lost(expectation.Expected(2, expectation.SCHEDULER, "SLURM_GPUS_ON_NODE=2"), 1)
    assert policy.action(lost.category, lost.severity) == policy.action(*jhardware.GPU_HANG) == policy.DRAIN
    assert policy.strongest([policy.REPORT, policy.DRAIN, policy.ALERT]) == policy.DRAIN


def _record(code: int, ranks: list[dict], checks: list[Check] = (), findings: list[Finding] = (),
            message: str = "") -> Report:
    """A run record as the ranks and the launcher leave it: checks with each failing rank's own findings."""
    return Report(ranks=ranks, checks=list(checks), findings=list(findings), override=(code, message), complete=True,
                  started=time.time())


def _gpu_ranks(*nodes: str, per_node: int = 1) -> list[dict]:
    return [{"rank": r, "node": node, "host": node, "gpu": {"index": g, "uuid": f"GPU-{node}-{g}",
                                                             "pci_bus_id": f"0000:{0x19 + g:02x}:00.0"}}
            for r, (node, g) in enumerate((n, g) for n in nodes for g in range(per_node))]


def _finding(rank: int, ranks: list[dict], category: str, severity: str, check: str = "x", gpu: bool = True) -> Finding:
    """A finding as rank `rank` stamps it (run/plugin.py's stamp): its node and rank, its GPU when about it."""
    ident = ranks[rank]
    where = ident["gpu"] if gpu else {}
    return Finding(where.get("index"), where.get("uuid", ""), check, "e", "f", category, severity, "fix",
                   node=ident["node"], rank=rank, pci_bus_id=where.get("pci_bus_id", ""), source=check)


def _failed(name: str, findings: list[Finding]) -> Check:
    check = Check(f"smoke_tests/test_x.py::test_{name}", "failed", failed_ranks=sorted({f.rank for f in findings}))
    check.findings = findings
    return check


def test_each_node_gets_the_strongest_action_of_its_own_findings():
    ranks = _gpu_ranks("a", "b")
    record = _record(1, ranks, [_failed("pins", [_finding(0, ranks, "software-pins", "triage"),
                                                 _finding(1, ranks, "software-pins", "triage")]),
                                _failed("computes", [_finding(1, ranks, "gpu-hardware", "isolate", "computes")]),
                                _failed("gemm", [_finding(0, ranks, "performance", "triage", "gemm")])])
    by_node = {a.node: a for a in decide.decide(record).actions}
    assert by_node["a"].action == policy.ALERT
    assert by_node["a"].reason == "stackproof: x GPU 0 GPU-a-0 PCI 0000:19:00.0 (+1 more)"
    assert by_node["b"].action == policy.DRAIN
    assert by_node["b"].reason == "stackproof: computes GPU 0 GPU-b-0 PCI 0000:19:00.0 (+1 more)"


def test_a_hang_pinned_on_one_gpu_drains_and_a_tool_timeout_does_not():
    ranks = _gpu_ranks("a", "b")
    inside_cuda = {"gpu": ranks[1]["gpu"], "node": "b", "in_cuda": "torch.cuda.synchronize", "gpu_util": 100,
                   "where": "test_x.py:3"}
    one = hang.hang_finding("collectives::barrier", 1, inside_cuda, 5)
    (action,) = decide.decide(_record(4, ranks, findings=[one], message="hung")).to_act
    assert (action.node, action.action) == ("b", policy.DRAIN)
    outside = hang.hang_finding("collectives::barrier", 1, {**inside_cuda, "in_cuda": ""}, 5)
    assert outside.category == "tool-error"
    assert decide.decide(_record(4, ranks, findings=[outside], message="hung")).drains == ()
    died = _record(4, ranks, message="rank 1 exited with signal SIGKILL")
    assert decide.decide(died).actions == () and "no finding that names a machine" in decide.decide(died).withheld


def test_nvidia_gpus_on_the_bus_reads_sysfs(tmp_path):
    for name, vendor, klass in (("0000:19:00.0", "0x10de", "0x030200"), ("0000:3b:00.0", "0x10de", "0x030000"),
                                ("0000:18:00.0", "0x10de", "0x068000"),  # an NVSwitch bridge: not a GPU
                                ("0000:00:02.0", "0x8086", "0x030000")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "class").write_text(klass + "\n")
    assert topology.nvidia_gpus_on_bus(str(tmp_path)) == ["0000:19:00.0", "0000:3b:00.0"]
    assert topology.nvidia_gpus_on_bus(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(("text", "pool", "cap"), [("2", 100, 2), ("10%", 100, 10), ("10%", 2, 1), ("0", 5, 0),
                                                   ("100%", 3, 3), ("12.5%", 8, 1)])
def test_max_drained_is_a_count_or_a_share_rounded_up(text, pool, cap):
    assert breaker.limit(text, pool) == cap


@pytest.mark.parametrize("text", ["", "-1", "1.5", "101%", "ten", "5 %%"])
def test_a_bad_max_drained_is_refused_with_the_fix(text):
    with pytest.raises(ConfigError, match="--max-drained: expected a node count such as 2 or a share"):
        ActConfig(scheduler="none", max_drained=text)


def test_act_without_scheduler_says_which_flag_and_the_fix():
    with pytest.raises(ConfigError) as err:
        ActConfig()
    assert "found no --scheduler; fix: pass --scheduler slurm or kubernetes" in str(err.value)
    assert "found none" not in str(err.value)


def _drains(*nodes: str) -> decide.Decision:
    return decide.Decision(Exit.FAILED, "", actions=tuple(decide.NodeAction(n, policy.DRAIN, f"stackproof: {n}")
                                                          for n in nodes))


def test_the_breaker_holds_every_new_drain_past_the_limit():
    fleet = breaker.Fleet(frozenset({"n1", "n2", "n3", "n4"}), frozenset({"n1"}))
    assert breaker.hold(_drains("n2"), fleet, "2").drains == _drains("n2").drains
    held = breaker.hold(_drains("n2", "n3"), fleet, "2")
    assert held.drains == () and {a.action for a in held.actions} == {policy.ALERT}
    assert "1 of 4 nodes already out of service by stackproof (n1); draining n2, n3 would pass --max-drained 2" \
        in held.actions[0].held
    assert breaker.hold(_drains("n1"), fleet, "1").drains  # draining it again adds nothing


def test_slurm_fleet_is_the_targets_partitions():
    sinfo = ("n1|gpu*|Unknown|none\nn2|gpu*|2026-12-01T10:00:00|stackproof: x\nn3|cpu|2026-12-01T10:00:01|"
             "stackproof: y\nn4|gpu*|2026-12-01T09:00:00|Not responding\n")
    assert slurm.fleet(sinfo, {"n1"}) == breaker.Fleet(frozenset({"n1", "n2", "n4"}), frozenset({"n2"}))


def test_kubernetes_fleet_is_the_gpu_pool_and_counts_the_taint():
    def node(name: str, gpu: bool, tainted: bool) -> dict:
        return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true"} if gpu else {}},
                "spec": {"taints": [{"key": kubernetes.TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
                         if tainted else []}}

    nodes = json.dumps({"items": [node("g1", True, True), node("g2", True, False), node("c1", False, True)]})
    assert kubernetes.fleet(nodes, {"g2"}) == breaker.Fleet(frozenset({"g1", "g2"}), frozenset({"g1"}))
    assert kubernetes.fleet(nodes, {"c1"}).pool == frozenset({"g1", "g2", "c1"})


def test_busy_gpus_are_read_from_nvml_and_left_alone(monkeypatch):
    """pynvml itself patched (the library beneath): GPU 1 runs a job's process; the plan checks 0 and 2 only."""
    pynvml = pytest.importorskip("pynvml")
    procs = {0: [], 1: [type("P", (), {"pid": 4242})()], 2: []}
    for name, fake in {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 3,
                       "nvmlDeviceGetHandleByIndex": lambda i: i, "nvmlDeviceGetUUID": lambda h: f"GPU-{h}aaa",
                       "nvmlDeviceGetComputeRunningProcesses": lambda h: procs[h],
                       "nvmlDeviceGetGraphicsRunningProcesses": lambda h: []}.items():
        monkeypatch.setattr(pynvml, name, fake)
    use = hardware.gpu_use()
    assert [(g.index, g.pids) for g in use] == [(0, ()), (1, (4242,)), (2, ())]
    plan = hardware.idle_plan(use, expect_gpus=3)
    assert (plan.cuda_visible_devices, plan.expect_gpus) == ("GPU-0aaa,GPU-2aaa", 2)
    assert plan.words == "skipping 1 GPU(s) in use: GPU 1 GPU-1aaa (pid 4242); checking 2, expecting 2"
    procs[0], procs[2] = procs[1], procs[1]
    assert hardware.idle_plan(hardware.gpu_use(), 3).nothing_idle
    assert hardware.idle_plan([hardware.GpuUse(0, "GPU-0", ())], None) == hardware.IdlePlan(None, None, "")


def test_nvml_failing_mid_way_is_said_not_skipped(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: (_ for _ in ()).throw(pynvml.NVMLError(15)))
    from stackproof.measure.topology import NvmlUnavailable

    with pytest.raises(NvmlUnavailable, match="NVML could not list the GPUs' processes"):
        hardware.gpu_use()


def test_busy_gpus_without_nvml_are_said_not_silently_skipped(monkeypatch, tmp_path):
    """--skip-busy-gpus names what it skips: where NVML cannot start, it says that it could skip nothing."""
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: (_ for _ in ()).throw(pynvml.NVMLError(9)))
    from stackproof.measure.topology import NvmlUnavailable

    with pytest.raises(NvmlUnavailable, match="NVML could not start"):
        hardware.gpu_use()
    monkeypatch.undo()
    proc = subprocess.run([sys.executable, "-m", "stackproof", "healthcheck", "--scheduler", "none",
                           "--skip-busy-gpus", "--expect-gpus", "0", "-k", "dev_shm", "--reports", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = r"^# stackproof healthcheck: --skip-busy-gpus: NVML could not start: .*; no GPU skipped$"
    assert re.search(said, proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize(("printed", "found"), [
    ('{"items": ["gpu-1"]}', "items[0] that is not a Node of that shape ('gpu-1')"),
    ('["gpu-1"]', "JSON without a list of items (list: \"['gpu-1']\")"),
    ("<html>502 Bad Gateway</html>", "text that is not JSON ('<html>502 Bad Gateway</html>')"),
    ('{"items": [{"metadata": {"name": "g1"}, "spec": {"taints": "none"}}]}', "items[0] that is not a Node"),
])
def test_odd_kubectl_output_is_said_as_what_kubectl_printed(printed, found):
    """Before: the breaker withheld the drain '(string indices must be integers, not 'str')'."""
    with pytest.raises(ValueError) as err:
        kubernetes.fleet(printed, {"gpu-1"})
    said = str(err.value)
    assert said.startswith(f"`kubectl get nodes -o json` printed {found}") and "expected a NodeList" in said, said
    assert "fix: check that kubectl talks to the cluster's API server" in said
