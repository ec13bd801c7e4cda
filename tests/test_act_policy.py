"""The policy table, the circuit breaker's arithmetic and the decision's special cases, without a scheduler or a GPU:
pure functions of recorded reports. The real runs that feed them are in test_act_kubernetes.py (a fault on one of
two "nodes"), test_act_healthcheck.py (faults from outside the suite) and test_act_slurm.py (slurmd itself)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stackproof.act import breaker, decide, hardware, kubernetes, policy, slurm
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.judge.findings import CATEGORIES, SEVERITIES
from stackproof.measure import topology
from stackproof.report.record import SCHEMA

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
    assert policy.action(*policy.GPUS_MISSING) == policy.action(*policy.GPU_HANG) == policy.DRAIN
    assert policy.strongest([policy.REPORT, policy.DRAIN, policy.ALERT]) == policy.DRAIN


def _report(code: int, checks: list[dict], ranks: list[dict], **extra) -> dict:
    """A report.json as suite/report.py writes it (nodes derived from the checks' failed ranks)."""
    nodes: dict[str, dict] = {}
    for r in ranks:
        nodes.setdefault(r["node"], {"node": r["node"], "ranks": [], "failed_checks": [], "verdict": "PASS"})
        nodes[r["node"]]["ranks"].append(r["rank"])
    for check in checks:
        for rank in check.get("failed_ranks", []):
            node = nodes[ranks[rank]["node"]]
            node["verdict"] = "FAIL"
            node["failed_checks"].append({"check": check["name"], "ranks": [rank], "category": check["category"],
                                          "severity": check["severity"]})
    return {"schema": SCHEMA, "exit_code": code, "message": extra.pop("message", ""), "ranks": ranks,
            "nodes": list(nodes.values()), "checks": checks, "started": "2026-01-01T00:00:00+00:00", **extra}


GPU_RANKS = [{"rank": 0, "node": "a", "gpu": {"index": 0, "pci_bus_id": "0000:19:00.0"}},
             {"rank": 1, "node": "b", "gpu": {"index": 0, "pci_bus_id": "0000:3b:00.0"}}]


def _check(name: str, ranks: list[int], category: str = "", severity: str = "", message: str = "") -> dict:
    return {"name": name, "outcome": "failed", "failed_ranks": ranks, "category": category, "severity": severity,
            "message": message}


def test_each_node_gets_the_strongest_action_of_its_failed_checks():
    report = _report(1, [_check("pins::versions", [0, 1], "software-pins", "triage"),
                         _check("gpus::every_gpu_computes", [1], "gpu-hardware", "isolate"),
                         _check("gemm", [0], "performance", "triage")], GPU_RANKS)
    by_node = {a.node: a for a in decide.decide(report).actions}
    assert by_node["a"].action == policy.ALERT and by_node["a"].reason == "stackproof: pins::versions GPU 0 PCI " \
                                                                          "0000:19:00.0 (+1 more)"
    assert by_node["b"].action == policy.DRAIN
    assert by_node["b"].reason == "stackproof: gpus::every_gpu_computes GPU 0 PCI 0000:3b:00.0 (+1 more)"


def test_a_hang_pinned_on_one_gpu_drains_and_a_wider_stall_does_not():
    message = "collectives::barrier did not finish within 5 s: rank(s) [1] stalled outside any collective"
    one = _report(4, [_check("collectives::barrier", [1], "interconnect", "triage", message)], GPU_RANKS,
                  message=message)
    (action,) = decide.decide(one).to_act
    assert (action.node, action.action) == ("b", policy.DRAIN)
    both = _report(4, [_check("collectives::barrier", [0, 1], "interconnect", "isolate", message)], GPU_RANKS,
                   message=message)
    assert {a.action for a in decide.decide(both).to_act} == {policy.ALERT}  # its own class does not count
    cpu = _report(4, [_check("x", [1], message=message)], [{k: v for k, v in r.items() if k != "gpu"}
                                                           for r in GPU_RANKS], message=message)
    assert {a.action for a in decide.decide(cpu).to_act} == {policy.ALERT}
    died = _report(4, [], GPU_RANKS, message="rank 1 exited with signal SIGKILL")
    assert decide.decide(died).actions == () and "names no machine" in decide.decide(died).withheld


def test_no_gpu_drains_only_when_the_scheduler_or_the_pci_bus_says_gpus_are_there():
    def no_gpu(reason: str) -> dict:
        return {"schema": SCHEMA, "exit_code": 3, "message": "no GPU visible", "nodes": [], "ranks": [],
                "context": {"expected_gpus": 8, "visible_gpus": 0, "reason": reason}}

    scheduler = decide.decide(no_gpu("SLURM_GPUS_ON_NODE=8 (the job's GPUs on this node)"), node="n2")
    assert [(a.node, a.action, a.reason) for a in scheduler.actions] == [
        ("n2", policy.DRAIN, "stackproof: no GPU visible, SLURM_GPUS_ON_NODE=8")]
    launch = decide.decide(no_gpu("NVIDIA_VISIBLE_DEVICES=all"), node="n2")
    assert launch.actions == () and "the launch, not the node" in launch.withheld
    assert decide.decide(no_gpu("--expect-gpus 8"), node="n2", gpus_on_pci=8).drains[0].reason == \
        "stackproof: no GPU visible, 8 NVIDIA GPU(s) on the PCI bus"


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
    sinfo = "n1|gpu*|none\nn2|gpu*|stackproof: x\nn3|cpu|stackproof: y\nn4|gpu*|Not responding\n"
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
    assert re.search(r"^# stackproof healthcheck: NVML could not start: .*: no GPU skipped$", proc.stdout, re.M), \
        proc.stdout


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
