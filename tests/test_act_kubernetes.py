"""stackproof act on real reports, and the Kubernetes side of it without a cluster (there is no API server here).

Real: the decision from the report.json of real runs (two "nodes" on this host, node names as the downward API
gives them, a fault on the second); kubectl itself applying the label and annotation to a Node object (--local);
kubectl itself parsing the taint; the DaemonSet and its RBAC. Not exercised here: a kubectl call reaching an API
server, the RBAC being enforced, the DaemonSet being scheduled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stackproof.act import decide, kubernetes
from stackproof.errors import Exit
from stackproof.judge import policy
from stackproof.judge.findings import Finding
from stackproof.report import outputs
from stackproof.report.record import Check, Report

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it is in the dev extra)")

REPO = Path(__file__).resolve().parents[1]
DAEMONSET = REPO / "scripts" / "kubernetes" / "daemonset.yaml"
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
ALLREDUCE = ["--expect-gpus", "0", "-k", "all_reduce and sum-float32", "--max-check-bytes", "64K", "--timeout", "60"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "STACKPROOF_", "PET_")) and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_node_fault(tmp_path_factory) -> Path:
    """A real run over two "nodes" (gpu-a, gpu-b: two launchers on this host, one rank each, static rendezvous)
    whose all_reduce is broken on gpu-b only (tests/fixtures/broken_allreduce on that node's PYTHONPATH)."""
    reports = tmp_path_factory.mktemp("two-node")
    port = str(_free_port())
    procs = [subprocess.Popen([PYTHON, "-m", "stackproof", "validate", "--nnodes", "2", "--node-rank", str(index),
                               "--master-addr", "127.0.0.1", "--master-port", port, "--nproc", "1",
                               "--reports", str(reports / node), *ALLREDUCE],
                              env=_env(STACKPROOF_NODE_NAME=node, GLOO_SOCKET_IFNAME="lo",
                                       PYTHONPATH=f"{BROKEN_ALLREDUCE}:{REPO}" if node == "gpu-b" else str(REPO)),
                              cwd=reports,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for index, node in enumerate(("gpu-a", "gpu-b"))]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    folder = reports / "gpu-a"  # rank 0's node holds the report
    assert (folder / "report.json").exists(), "\n".join(o[-3000:] for o in outputs)
    return folder


@pytest.fixture(scope="module")
def one_node_pass(tmp_path_factory) -> Path:
    reports = tmp_path_factory.mktemp("pass")
    proc = subprocess.run([PYTHON, "-m", "stackproof", "validate", "--reports", str(reports), *ALLREDUCE],
                          env=_env(STACKPROOF_NODE_NAME="gpu-a"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return reports


# --- the decision, from real reports ------------------------------------------------------------------------

def _every_node_found(record: Report, category: str, severity: str) -> Report:
    """The record with each node's rank finding the same (category, severity): a fault on every node."""
    found = [Finding(None, "", "x", "e", "f", category, severity, "fix", node=r["node"], rank=r["rank"], source="x")
             for r in record.ranks]
    check = Check("smoke_tests/test_02_gpus.py::test_x", "failed", failed_ranks=[r["rank"] for r in record.ranks],
                  findings=found)
    return dataclasses.replace(record, checks=[check])


def test_a_failed_check_acts_on_its_node_only(two_node_fault):
    record = Report.read(two_node_fault)
    assert record.exit_code == Exit.FAILED and record.world["nodes"] == 2
    decision = decide.decide(record)
    assert sorted((a.node, a.failed) for a in decision.actions) == [("gpu-a", False), ("gpu-b", True)]
    (failed,) = decision.to_act
    assert failed.reason == "stackproof: collectives::all_reduce[sum-float32] rank 1"
    assert len(failed.reason) <= decide.REASON_MAX


def test_a_passing_run_acts_on_nothing(one_node_pass):
    decision = decide.decide(Report.read(one_node_pass), exit_code=0)
    assert decision.to_act == () and [a.node for a in decision.actions] == ["gpu-a"]
    assert decision.summary() == "every node passed: nothing to act on"


@pytest.mark.parametrize("code", [Exit.USAGE, Exit.INTERRUPTED])
def test_outcomes_that_say_nothing_about_the_machine_act_on_nothing(two_node_fault, code):
    record = dataclasses.replace(Report.read(two_node_fault), override=(int(code), "stopped"))
    decision = decide.decide(record)
    assert decision.actions == () and f"exit code {int(code)}" in decision.withheld


def test_a_hardware_check_that_failed_before_a_run_stopped_still_drains(two_node_fault):
    """Exit 4 (say a later check hung): the findings made before it were judged, and act."""
    record = dataclasses.replace(Report.read(two_node_fault), override=(int(Exit.INCOMPLETE), "a later check hung"))
    (action,) = decide.decide(record).to_act
    assert (action.node, action.action) == ("gpu-b", policy.DRAIN)


def test_a_stale_or_foreign_report_acts_on_nothing(two_node_fault):
    record = Report.read(two_node_fault)
    assert "stale" in decide.decide(record, not_before=record.started + 3600).withheld
    assert decide.decide(record, exit_code=4).actions == ()  # the run said 4, the file says 1


def test_max_nodes_withholds_a_fleet_wide_failure(two_node_fault):
    record = _every_node_found(Report.read(two_node_fault), "gpu-hardware", "isolate")
    withheld = decide.decide(record, max_nodes=1)
    assert withheld.drains == () and {a.action for a in withheld.actions} == {policy.ALERT}
    assert all("more than --max-nodes 1" in a.held for a in withheld.actions)
    assert len(decide.decide(record).drains) == 2


def test_an_image_fault_on_every_node_alerts_and_drains_nothing(two_node_fault):
    decision = decide.decide(_every_node_found(Report.read(two_node_fault), "software-pins", "triage"))
    assert decision.drains == () and [a.action for a in decision.actions] == [policy.ALERT, policy.ALERT]


def test_reason_stays_one_short_line():
    text = decide.fit("stackproof: " + "x" * 300 + "\nsecond line")
    assert len(text) == decide.REASON_MAX and "\n" not in text and text.endswith("...")


def test_act_cli_dry_run_and_bad_reports(two_node_fault, tmp_path):
    proc = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(two_node_fault), "--scheduler", "none"],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "# stackproof act: gpu-b: drain: stackproof: collectives::all_reduce[sum-float32] rank 1" in proc.stdout
    assert "run:" not in proc.stdout
    proc = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(tmp_path), "--scheduler", "slurm"],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "found no such file; fix:" in proc.stderr


# --- kubectl itself, on a Node object (no API server here) --------------------------------------------------

needs_kubectl = pytest.mark.skipif(not shutil.which("kubectl"), reason="no kubectl on PATH")

NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-b", "labels": {"kubernetes.io/hostname": "gpu-b"},
                                                         "annotations": {}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}}


def _kubectl_local(action: decide.NodeAction, tmp_path: Path) -> dict:
    """Apply the label and annotate commands to NODE with kubectl --local; the resulting Node object."""
    node = tmp_path / "node.json"
    node.write_text(json.dumps(NODE))
    for argv in kubernetes.commands(action, target=["-f", str(node), "--local", "-o", "json"]):
        if argv[1] == "taint":
            continue  # kubectl taint has no --local (test below)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        node.write_text(proc.stdout)
    return json.loads(node.read_text())


@needs_kubectl
def test_kubectl_labels_and_annotates_a_failed_node(two_node_fault, tmp_path):
    (action,) = decide.decide(Report.read(two_node_fault)).to_act
    node = _kubectl_local(action, tmp_path)
    assert node["metadata"]["labels"][kubernetes.VERDICT_LABEL] == "fail"
    assert node["metadata"]["annotations"][kubernetes.CHECK_ANNOTATION] == action.reason
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "gpu-b"  # nothing else changes
    assert node["spec"] == NODE["spec"]


@needs_kubectl
def test_kubectl_labels_a_passing_node_and_clears_the_check(one_node_pass, tmp_path):
    (action,) = decide.decide(Report.read(one_node_pass)).actions
    NODE["metadata"]["annotations"] = {kubernetes.CHECK_ANNOTATION: "stackproof: an earlier failure"}
    try:
        node = _kubectl_local(action, tmp_path)
    finally:
        NODE["metadata"]["annotations"] = {}
    assert node["metadata"]["labels"][kubernetes.VERDICT_LABEL] == "pass"
    assert kubernetes.CHECK_ANNOTATION not in node["metadata"].get("annotations", {})
    assert not [argv for argv in kubernetes.commands(action) if argv[1] == "taint"]  # a person lifts the taint


@needs_kubectl
def test_kubectl_accepts_the_taint(tmp_path):
    """kubectl parses the taint before it contacts a server: with none here, a valid taint gets as far as the
    connection, a broken one does not."""
    failed = decide.NodeAction("gpu-b", policy.DRAIN, "stackproof: x")
    (taint,) = [argv for argv in kubernetes.commands(failed) if argv[1] == "taint"]
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    for argv, expected in ((taint, "refused"), ([*taint[:-2], taint[-2].replace("NoSchedule", "NoSched"),
                                                 taint[-1]], "invalid taint effect")):
        proc = subprocess.run([*argv, "--dry-run=client", "--request-timeout=3s",
                               "--server=http://127.0.0.1:1"], capture_output=True, text=True, env=env, timeout=30,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-1000:]


@needs_kubectl
def test_act_tries_every_node_and_reports_each_failure(two_node_fault, tmp_path):
    """kubectl with no reachable cluster fails for every node: each is tried and named, the breaker (which
    cannot count the tainted nodes) holds the drains, and act exits 2."""
    outputs.write(_every_node_found(Report.read(two_node_fault), "gpu-hardware", "isolate"), tmp_path)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "none",
                                      "clusters": [{"name": "none", "cluster": {"server": "http://127.0.0.1:1"}}],
                                      "contexts": [{"name": "none", "context": {"cluster": "none"}}]}))
    proc = subprocess.run([PYTHON, "-m", "stackproof", "act", "--reports", str(tmp_path), "--scheduler", "kubernetes",
                           "--act-timeout", "20"], env=_env(KUBECONFIG=str(kubeconfig)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "drain withheld: could not count the nodes already out of service" in proc.stdout
    for node in ("gpu-a", "gpu-b"):
        assert f"FAILED: act on {node}: `kubectl label node {node}" in proc.stdout, proc.stdout
    assert "2 node action(s) failed: act on gpu-a; act on gpu-b" in proc.stdout


# --- the DaemonSet and its RBAC -----------------------------------------------------------------------------

def _docs() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(DAEMONSET.read_text()) if doc}


def test_rbac_may_only_read_and_patch_nodes():
    docs = _docs()
    # get + patch: kubectl label / annotate / taint; list: the circuit breaker counts the tainted nodes.
    assert docs["ClusterRole"]["rules"] == [{"apiGroups": [""], "resources": ["nodes"],
                                             "verbs": ["get", "list", "patch"]}]
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    (subject,) = binding["subjects"]
    account = docs["ServiceAccount"]["metadata"]
    assert (subject["kind"], subject["name"], subject["namespace"]) == ("ServiceAccount", account["name"],
                                                                        account["namespace"])
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]


def test_daemonset_pod_runs_healthcheck_on_its_own_node():
    pod = _docs()["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "command" not in container  # the image's entrypoint (tini) stays
    script = container["args"][2]
    assert "python3 -m stackproof healthcheck --scheduler kubernetes" in script
    assert '--node "$STACKPROOF_NODE_NAME"' in script and "exec sleep infinity" in script
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["STACKPROOF_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # It holds no GPU while it sleeps, so it leaves the GPUs a job uses alone; it must still be scheduled on a
    # node it has tainted.
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "--skip-busy-gpus" in container["args"]
    assert {"key": kubernetes.TAINT_KEY, "operator": "Exists"} in pod["tolerations"]
    # kubectl comes from the init container, into the folder put first on PATH.
    (init,) = pod["initContainers"]
    assert "kubectl" in init["image"] and "/tools/kubectl" in " ".join(init["command"])
    assert 'PATH="/tools:$PATH"' in script


def test_daemonset_flags_are_healthcheck_flags():
    """The flags after $0 parse, and the run stays bounded: --run-timeout with --timeout inside it."""
    from stackproof.act.config import ActConfig
    from stackproof.cli import build_parser
    from stackproof.run.config import ValidateConfig

    (container,) = _docs()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    flags = container["args"][4:]
    args = build_parser().parse_args(["healthcheck", "--scheduler", "kubernetes", "--expect-gpus", "8", *flags])
    settings, act = ValidateConfig.from_args(args), ActConfig.from_args(args)
    assert settings.tier == "fast" and settings.run_timeout <= 3600 and act.scheduler == "kubernetes"
    assert act.skip_busy_gpus
    assert act.ranks_budget_s >= settings.run_timeout  # --deadline leaves the ranks their --run-timeout
