"""The run record's exit code is a function of what it holds (docs/report-format.md): its checks' outcomes and every
finding, the run's own included (a GPU lost at pre-flight, a rank the kernel could not kill), the same when the
record is read back from report.json. Pure: no torch, no process."""

from __future__ import annotations

import json

from stackproof.errors import Exit
from stackproof.judge.findings import Finding
from stackproof.report.record import Check, Report

NODE = "gpu-node-7"
RANKS = [{"rank": 0, "node": NODE, "host": NODE, "node_rank": 0, "local_rank": 0, "gpu": None}]
LOST = Finding(None, "", "GPUs visible", "8 GPUs on the PCI bus", "7 seen by NVML", "gpu-hardware", "isolate",
               "reseat or replace the GPU", node=NODE, source="pre-flight")


def finished(*checks: Check, findings: list[Finding] = ()) -> Report:
    report = Report(ranks=list(RANKS), checks=list(checks), findings=list(findings), complete=True)
    report.planned = [c.nodeid for c in checks]
    return report


def read_back(report: Report) -> Report:
    return Report.from_json(json.loads(json.dumps(report.to_json(), default=str)))


def test_every_check_passed_and_no_finding_is_ok():
    report = finished(Check("test_01_host.py::test_dev_shm_is_large_enough"))
    assert report.exit_code == Exit.OK and read_back(report).exit_code == Exit.OK


def test_a_finding_of_the_run_itself_fails_it_though_every_check_passed():
    report = finished(Check("test_01_host.py::test_dev_shm_is_large_enough"), findings=[LOST])
    assert report.exit_code == Exit.FAILED
    assert report.message.startswith("every check passed, but the run found: ") and "7 seen by NVML" in report.message
    written = report.to_json()
    assert (written["exit_code"], written["verdict"]) == (1, "FAILED")
    assert read_back(report).exit_code == Exit.FAILED and read_back(report).message == report.message
    assert [n["verdict"] for n in written["nodes"]] == ["FAIL"]  # the node it names is the one to drain


def test_a_checks_finding_fails_the_run_whatever_outcome_was_written():
    found = Check("test_02_per_gpu.py::test_health_history", findings=[LOST])
    assert finished(found).exit_code == Exit.FAILED
    failed = Check("test_02_per_gpu.py::test_health_history", "failed", message="GPU lost", failed_ranks=[0])
    assert finished(failed).exit_code == Exit.FAILED and finished(failed).message == Exit.FAILED.meaning


def test_what_stops_the_run_outranks_its_findings():
    # An interruption or a dead rank is said as such (the findings still go to act/ in report.json).
    stopped = finished(Check("test_01_host.py::test_dev_shm_is_large_enough"), findings=[LOST])
    stopped.override = (int(Exit.INTERRUPTED), "interrupted by SIGTERM after 1 of 1 checks")
    assert stopped.exit_code == Exit.INTERRUPTED and read_back(stopped).exit_code == Exit.INTERRUPTED
    running = finished(Check("test_01_host.py::test_dev_shm_is_large_enough"), findings=[LOST])
    running.complete = False
    assert running.exit_code == Exit.INCOMPLETE
