"""Back in service only by proof, without a scheduler: the remedy table, the node history's rules (a lemon is
held), the re-proof's depth and outcome, the standing read from the scheduler's own output, and on Kubernetes
the return applied by kubectl itself to a Node object (--local) and its taint removal parsed by kubectl (no API
server here). The real thing, slurmd running the health check on a drained node, is test_act_resume_slurm.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from stackproof.act import config, decide, history, kubernetes, resume
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.judge import policy
from stackproof.judge.findings import CATEGORIES, SEVERITIES, Finding
from stackproof.report import metrics, outputs, terminal
from stackproof.report.record import Check, Report
from stackproof.run.config import TIERS

REPO = Path(__file__).resolve().parents[1]
DAY = 86400.0
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


# --- the remedy: every finding's, from the policy table -------------------------------------------------------
def test_every_category_and_severity_has_a_remedy_of_known_steps_and_docs_print_it():
    assert set(policy.REMEDIES) == {(c, s) for c in CATEGORIES for s in SEVERITIES}
    for key, steps in policy.REMEDIES.items():
        assert steps and set(steps) <= set(policy.STEPS), key
        if policy.TABLE[key] == policy.DRAIN:  # the machine's fault: its last step is servicing the hardware
            assert steps[-1] == policy.SERVICE, key
        if key[0] in ("software-pins", "configuration", "unclassified", "tool-error"):  # never the hardware's
            assert not set(steps) & policy.OUT_OF_SERVICE_STEPS, key
    assert policy.remedy("gpu-hardware", "reset") == (policy.KILL_PROCESS, policy.RESET_GPU, policy.REBOOT,
                                                      policy.SERVICE)
    assert policy.remedy("", "") == (policy.RERUN,)
    assert policy.remedies_markdown() in (REPO / "docs" / "act.md").read_text()


def _record() -> Report:
    ranks = [{"rank": 0, "node": "n2", "host": "n2", "node_rank": 0, "local_rank": 0,
              "gpu": {"index": 3, "uuid": "GPU-3", "pci_bus_id": "0:19"}}]
    hang = Finding(3, "GPU-3", "a kernel that never ends", "progress", "no progress for 60 s", "gpu-hardware",
                   "reset", "reset the GPU", node="n2", rank=0, source="collectives::barrier")
    check = Check("test_04_collectives.py::test_barrier", outcome="failed", failed_ranks=[0], findings=[hang])
    report = Report(ranks=ranks, checks=[check], complete=True, started=time.time())
    report.planned = [check.nodeid]
    return report


def test_the_remedy_is_in_report_json_the_table_and_the_textfile():
    report = _record()
    (entry,) = report.to_json()["remedies"]
    assert entry["node"] == "n2" and entry["gpu_index"] == 3 and entry["check"] == "collectives::barrier"
    assert [s["step"] for s in entry["steps"]] == ["kill-process", "reset-gpu", "reboot", "service"]
    assert entry["action"] == policy.DRAIN and all(s["do"] for s in entry["steps"])
    assert ("#   n2 GPU 3: collectives::barrier [gpu-hardware, reset]: kill-process -> reset-gpu -> reboot -> "
            "service") in terminal.table(report)
    assert (f'{metrics.FINDING_REMEDY}{{node="n2",gpu="3",rank="0",check="collectives::barrier",'
            'first_step="kill-process",steps="kill-process>reset-gpu>reboot>service"} 1') in metrics.textfile(report)


def test_a_run_without_findings_prints_no_remedy():
    report = _record()
    report.checks[0].outcome, report.checks[0].findings, report.checks[0].failed_ranks = "passed", [], []
    assert report.to_json()["remedies"] == [] and "remedy" not in terminal.table(report)
    assert metrics.FINDING_REMEDY not in metrics.textfile(report)


# --- the history: a lemon is held -----------------------------------------------------------------------------
def _ev(day: float, kind: str) -> history.Event:
    return history.Event(day * DAY, kind, run=f"run-{day:g}")


def test_taken_out_again_within_the_window_after_a_return_is_a_lemon():
    life = [_ev(0, history.TAKEN_OUT), _ev(0.5, history.REPROVED), _ev(0.5, history.RETURNED),
            _ev(3, history.TAKEN_OUT)]
    why = history.needs_service(life, 3 * DAY)
    assert why.startswith("taken out 2 times in 7 days, again after its return (run-0, run-3): needs service")
    # the same two take-outs 8 days apart: not a lemon; two without a return between (kept out, never back): not
    assert history.needs_service([*life[:3], _ev(8, history.TAKEN_OUT)], 8 * DAY) == ""
    assert history.needs_service([_ev(0, history.TAKEN_OUT), _ev(1, history.KEPT_OUT), _ev(2, history.TAKEN_OUT)],
                                 2 * DAY) == ""
    # a wider rule from the settings
    assert history.needs_service([*life[:3], _ev(8, history.TAKEN_OUT)], 8 * DAY, history.Rule(9 * DAY, 2))
    assert history.needs_service(life, 3 * DAY, history.Rule(7 * DAY, 3)) == ""


def test_a_hold_lasts_until_a_person_services_the_node():
    held = [_ev(0, history.TAKEN_OUT), _ev(1, history.RETURNED), _ev(2, history.TAKEN_OUT),
            history.Event(2 * DAY, history.HELD, "run-2", "stackproof: needs service: x")]
    assert history.needs_service(held, 30 * DAY) == "x"  # past the window: still held (its words, no prefix)
    assert history.out_of_service(held)
    serviced = [*held, _ev(31, history.SERVICED)]
    assert history.needs_service(serviced, 31 * DAY) == "" and not history.out_of_service(serviced)
    assert history.needs_service([*serviced, _ev(32, history.TAKEN_OUT)], 32 * DAY) == ""  # its count starts anew


def test_the_history_round_trips_and_a_damaged_one_is_said(tmp_path):
    events = [_ev(0, history.TAKEN_OUT), _ev(1, history.RETURNED)]
    for event in events:
        history.append(tmp_path, "n2", event)
    assert history.load(tmp_path, "n2") == events and history.load(tmp_path, "n9") == []
    history.path(tmp_path, "n2").write_text("{not json")
    with pytest.raises(ValueError, match="expected a stackproof node history"):
        history.load(tmp_path, "n2")


def test_the_history_metrics_pass_promtool_lint(tmp_path):
    life = [_ev(0, history.TAKEN_OUT), _ev(1, history.RETURNED), _ev(2, history.TAKEN_OUT),
            _ev(2, history.HELD)]
    text = history.textfile("n2", life, 2 * DAY)
    assert f'{history.NEEDS_SERVICE}{{node="n2"}} 1' in text and f'{history.OUT_OF_SERVICE}{{node="n2"}} 1' in text
    assert f'{history.TAKEN_OUT_IN_WINDOW}{{node="n2",window="604800"}} 2' in text
    assert f'{history.LAST_RETURNED}{{node="n2"}} {int(DAY)}' in text
    assert f'{history.NEEDS_SERVICE}{{node="n2"}} 0' in history.textfile("n2", life[:2], 2 * DAY)
    if shutil.which("promtool"):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=60)
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
    history.export(tmp_path, "n2", life, 2 * DAY)
    copy = json.loads((tmp_path / history.RUN_COPY).read_text())
    assert copy["schema"] == history.SCHEMA and copy["needs_service"] and len(copy["events"]) == 4


# --- the re-proof: deeper by default, its outcome -------------------------------------------------------------
def test_the_default_reproof_is_the_full_tier_then_the_burn_soak_deeper_than_the_health_check():
    settings = ActConfig(scheduler="slurm")
    assert settings.reproof == ("full", "burn") and settings.reproof == config.REPROOF_TIERS
    assert {"fast": {"fast"}, "full": {"fast", "full"}, "burn": {"fast", "soak"}} == resume.TIER_CHECKS
    assert set(resume.TIER_CHECKS) == set(TIERS)
    assert resume.covers(settings.reproof, "fast") == (True, True)  # healthcheck's default tier
    assert resume.covers(settings.reproof, "full") == (True, True)
    assert resume.covers(("full",), "full") == (True, False)  # as deep: allowed, said
    assert resume.reproof_problem(("fast",), "full").startswith("--reproof-tiers fast: expected a proof at least")
    assert resume.reproof_problem(("burn",), "full") and resume.reproof_problem(("full",), "burn")
    with pytest.raises(ConfigError, match="--reproof-tiers"):
        ActConfig(scheduler="slurm", reproof_tiers="full,deep")
    with pytest.raises(ConfigError, match="--lemon-count"):
        ActConfig(scheduler="slurm", lemon_count=1)


def _drain(node: str = "n2") -> decide.NodeAction:
    finding = Finding(None, "", "all_reduce", "sums", "wrong sums", "interconnect", "isolate", "x", node=node,
                      rank=0, source="collectives::all_reduce")
    return decide.node_action(node, [finding])


def test_the_reproof_returns_keeps_out_or_holds():
    passed = [("full", Exit.OK, decide.NodeAction("n2", decide.PASS)), ("burn", Exit.OK, None)]
    back = resume.judge(passed, "r1", lemon="")
    assert back.verdict == resume.RETURN and back.reason == "stackproof: returned by re-proof r1 (full+burn passed)"
    image_fault = [("full", Exit.FAILED, decide.NodeAction("n2", policy.ALERT, "stackproof: pins"))]
    assert resume.judge(image_fault, "r1", "").verdict == resume.RETURN  # not the node's fault
    kept = resume.judge([("full", Exit.FAILED, _drain())], "r2", "")
    assert kept.verdict == resume.KEEP_OUT and kept.reason == "stackproof: re-proof r2 failed: " \
        "collectives::all_reduce rank 0" and kept.remedy == policy.remedy("interconnect", "isolate")
    incomplete = resume.judge([("full", Exit.OK, None), ("burn", Exit.INCOMPLETE, None)], "r3", "")
    assert incomplete.verdict == resume.KEEP_OUT and "(burn) not proven: exit 4" in incomplete.reason
    held = resume.judge(passed, "r4", lemon="taken out 2 times in 7 days")
    assert held.verdict == resume.HOLD and held.reason.startswith("stackproof: needs service: taken out 2")
    assert all(len(o.reason) <= decide.REASON_MAX for o in (back, kept, incomplete, held))


def _scontrol(state: str, reason: str = "") -> str:
    """`scontrol show node n2 --oneliner` as Slurm 22.05 prints it (fields cut for length)."""
    why = f" Reason={reason} [root@2026-12-03T09:47:48]" if reason else ""
    return (f"NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 State={state} ThreadsPerCore=1 "
            f"Partitions=debug,trio  BootTime=2026-12-03T09:16:34 CapWatts=n/a{why} Comment=hello there\n")


def test_slurm_standing_from_scontrol():
    assert resume.slurm_query("n2")[:3] == ["scontrol", "show", "node"]
    assert resume.standing_of_slurm(_scontrol("IDLE+DRAIN", "stackproof: x [y] rank 0"), "n2") == resume.Standing(
        resume.OURS, "stackproof: x [y] rank 0")
    assert resume.standing_of_slurm(_scontrol("MIXED+DRAIN", "stackproof: a=b c"), "n2").state == resume.OURS
    assert resume.standing_of_slurm(_scontrol("IDLE+DRAIN", "operator: PSU"), "n2") == resume.Standing(
        resume.OTHER, "idle+drain: operator: PSU")
    assert resume.standing_of_slurm(_scontrol("DOWN*", "Not responding"), "n2").state == resume.OTHER
    assert resume.standing_of_slurm(_scontrol("DOWN+DRAIN", "stackproof: x"), "n2").state == resume.OURS
    assert resume.standing_of_slurm(_scontrol("IDLE"), "n2").state == resume.IN_SERVICE
    assert resume.standing_of_slurm(_scontrol("MIXED"), "n2").state == resume.IN_SERVICE
    assert resume.standing_of_slurm(_scontrol("IDLE"), "n22").state == resume.UNKNOWN
    assert resume.standing_of_slurm("", "n2").state == resume.UNKNOWN
    assert resume.commands("slurm", "n2", resume.Outcome(resume.RETURN, "stackproof: returned by re-proof r1")) == [
        ["scontrol", "update", "nodename=n2", "state=resume"],
        ["scontrol", "update", "nodename=n2", "comment=stackproof: returned by re-proof r1"]]


# --- Kubernetes: kubectl itself, against a Node object ---------------------------------------------------------
NODE = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "gpu-b", "labels": {"nvidia.com/gpu.present": "true", kubernetes.VERDICT_LABEL: "fail"},
                     "annotations": {kubernetes.CHECK_ANNOTATION: "stackproof: collectives::all_reduce rank 0"}},
        "spec": {"unschedulable": True,  # an operator's cordon beside stackproof's taint: it stays
                 "taints": [{"key": kubernetes.TAINT_KEY, "value": "true", "effect": "NoSchedule"},
                            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}


def test_kubernetes_standing_from_a_node_object():
    assert resume.standing_of_kubernetes(json.dumps(NODE)) == resume.Standing(
        resume.OURS, "stackproof: collectives::all_reduce rank 0")
    other = {**NODE, "spec": {"taints": [{"key": "maintenance", "effect": "NoExecute"}]}}
    assert resume.standing_of_kubernetes(json.dumps(other)) == resume.Standing(resume.OTHER, "maintenance:NoExecute")
    assert resume.standing_of_kubernetes(json.dumps({**NODE, "spec": {"unschedulable": True}})).state == resume.OTHER
    assert resume.standing_of_kubernetes(json.dumps({**NODE, "spec": {}})).state == resume.IN_SERVICE


@needs_kubectl
def test_kubectl_applies_the_return_and_parses_the_taint_removal(tmp_path):
    """The return's label and annotations applied by kubectl itself to the Node (--local: no server); `kubectl
    taint` has no --local, so its removal of stackproof's taint is parsed by kubectl up to the connection (a
    broken key is refused before it). A failed re-proof's commands put the evidence back on the node."""
    node = tmp_path / "node.json"
    node.write_text(json.dumps(NODE))
    back = resume.Outcome(resume.RETURN, "stackproof: returned by re-proof 20261203T0930-1 (full+burn passed)")
    where = ["-f", str(node), "--local", "-o", "json"]
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    taints = []
    for argv in resume.commands("kubernetes", "gpu-b", back, target=where):
        if argv[1] == "taint":
            taints.append(argv)
            continue
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
        assert proc.returncode == 0, proc.stderr
        node.write_text(proc.stdout)
    obj = json.loads(node.read_text())
    assert obj["metadata"]["labels"][kubernetes.VERDICT_LABEL] == "pass"
    assert obj["metadata"]["annotations"] == {resume.RETURNED_ANNOTATION: back.reason}
    assert obj["spec"] == NODE["spec"]  # the cordon is the operator's: untouched (the taint: below)
    (taint,) = [argv for argv in resume.commands("kubernetes", "gpu-b", back) if argv[1] == "taint"]
    assert taint == ["kubectl", "taint", "node", "gpu-b", f"{kubernetes.TAINT_KEY}-"] and len(taints) == 1
    for argv, expected in ((taint, "refused"), ([*taint[:-1], "stackproof.io/un healthy-"], "invalid")):
        proc = subprocess.run([*argv, "--dry-run=client", "--request-timeout=3s", "--server=http://127.0.0.1:1"],
                              capture_output=True, text=True, env=env, timeout=30, stdin=subprocess.DEVNULL)
        assert proc.returncode != 0 and expected in proc.stderr.lower(), proc.stderr[-1000:]
    kept = resume.Outcome(resume.HOLD, "stackproof: needs service: taken out 2 times in 7 days")
    node.write_text(json.dumps({**NODE, "metadata": {**NODE["metadata"], "annotations": {}}}))
    for argv in resume.commands("kubernetes", "gpu-b", kept, target=where):
        if argv[1] != "taint":
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
            assert proc.returncode == 0, proc.stderr
            node.write_text(proc.stdout)
    annotations = json.loads(node.read_text())["metadata"]["annotations"]
    assert annotations == {kubernetes.CHECK_ANNOTATION: kept.reason, resume.SERVICE_ANNOTATION: kept.reason}


# --- the page: each node's history and every finding's remedy ---------------------------------------------------
def test_the_page_shows_each_nodes_history_and_the_remedies(tmp_path):
    from stackproof.report import fleet, page

    assert (fleet.HISTORY_FILE, fleet.HISTORY_SCHEMA) == (history.RUN_COPY, history.SCHEMA)
    now = 10 * DAY
    lives = {"n1": [_ev(1, history.TAKEN_OUT), _ev(2, history.RETURNED)],
             "n2": [history.Event(8 * DAY, history.TAKEN_OUT, "run-8", "stackproof: collectives::barrier GPU 3",
                                  policy.remedy("gpu-hardware", "reset")),
                    _ev(8.5, history.RETURNED), _ev(9, history.TAKEN_OUT),
                    history.Event(9 * DAY, history.HELD, "run-9", "stackproof: needs service: taken out 2 times")]}
    folders = []
    for node, life in lives.items():
        report = _record()
        report.ranks = [{**report.ranks[0], "node": node, "host": node}]
        report.checks[0].findings = [dataclasses.replace(report.checks[0].findings[0], node=node)]
        folder = tmp_path / node
        outputs.write(report, folder)
        history.export(folder, node, life, now)
        folders.append(folder)
    (tmp_path / "n3").mkdir()
    outputs.write(_record(), tmp_path / "n3")  # a report without a history: no row, no error
    out, _ = page.write([*folders, tmp_path / "n3"], tmp_path / "page.html")
    html = out.read_text()
    section = html[html.index("<h2>Node history</h2>"):]
    assert section.index(">n1<") < section.index(">n2<")
    n2 = section[section.index(">n2<"):]
    assert "out: needs service (taken out 2 times)" in n2
    assert "<b>taken-out</b> run run-8: stackproof: collectives::barrier GPU 3 (remedy: kill-process -&gt; " \
           "reset-gpu -&gt; reboot -&gt; service)" in n2
    assert '<td class="back">in service</td>' in section[:section.index(">n2<")]
    remedies = html[html.index("<h2>Remedies</h2>"):html.index("<h2>Node history</h2>")]
    # one row per node and finding: n1's, n2's (n3's report names n2's same finding: not twice)
    assert remedies.count("<li><b>kill-process</b>") == 2 and ">n2<" in remedies and ">n1<" in remedies
