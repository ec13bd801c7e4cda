"""No PASS without a judgement (stackproof/judge/verdict.py): the checks a tier promises on a kind of host must
pass or fail, and a run that judged nothing is not OK. Judged from a recorded report (a 2 x H200 fast-tier run,
tests/fixtures/spec/) with checks skipped or missing as real runs leave them, and for real on CPU ranks."""

import ast
import copy
import json
from pathlib import Path

import pytest
from test_validate_cpu import validate

from stackproof.errors import Exit
from stackproof.judge import verdict
from stackproof.report.record import Check, Report
from stackproof.run import smoke_tests_dir

FIXTURE = Path(__file__).parent / "fixtures" / "spec" / "h200x2-report.json"
HBM = "smoke_tests/test_02_per_gpu.py::test_hbm_bandwidth"


@pytest.fixture
def recorded():
    return json.loads(FIXTURE.read_text())


def settled(data) -> Report:
    return Report.from_json(data)


def skip(data, nodeid, reason):
    check = next(c for c in data["checks"] if c["nodeid"] == nodeid)
    check.update(outcome="skipped", verdict="SKIP", message=reason)


def test_a_gpu_run_that_judged_what_its_tier_promises_is_ok(recorded):
    report = settled(recorded)
    assert report.exit_code == Exit.OK and report.unjudged() == [] and report.left_out() == []
    assert verdict.host_kind(recorded["world"]) == "gpu"


def test_a_promised_check_that_skipped_is_not_ok(recorded):
    skip(recorded, HBM, "no bar: NVML reports no memory bus width for this GPU")
    report = settled(recorded)
    assert report.exit_code == Exit.INCOMPLETE
    assert report.message == ("not judged: per_gpu::hbm_bandwidth: skipped: no bar: NVML reports no memory bus "
                              "width for this GPU (tier fast on a GPU host promises these: docs/report-format.md)")
    data = report.to_json()
    assert data["verdict"] == "FAILED" and data["promise"]["not_judged"] == [report.unjudged()[0]]
    assert "# Verdict: FAILED (exit code 4" in report.table() and "# not judged: per_gpu::hbm_bandwidth" in \
        report.table()


def test_a_check_that_did_not_skip_but_is_not_in_the_suite_is_not_judged(recorded):
    """An image whose smoke_tests lack a promised check (an older suite) cannot pass on its word."""
    gone = [c["nodeid"] for c in recorded["checks"] if "test_02_gpus.py" in c["nodeid"]]
    recorded["checks"] = [c for c in recorded["checks"] if c["nodeid"] not in gone]
    recorded["planned"] = [n for n in recorded["planned"] if n not in gone]
    report = settled(recorded)
    assert report.exit_code == Exit.INCOMPLETE
    names = ("torch_sees_the_expected_gpus", "gpus_have_what_they_should", "driver_supports_the_image_cuda",
             "every_gpu_computes")
    assert report.unjudged() == [f"gpus::{name}: not in this run's suite" for name in names]


def test_a_failure_is_said_before_what_was_not_judged(recorded):
    skip(recorded, HBM, "no bar")
    failed = next(c for c in recorded["checks"] if c["name"] == "per_gpu::sdc_digest")
    failed.update(outcome="failed", verdict="FAIL", failed_ranks=[1], message="digest differs")
    assert settled(recorded).exit_code == Exit.FAILED


def test_k_narrows_the_promise_and_names_what_it_left_out(recorded):
    per_gpu = [c for c in recorded["checks"] if c["name"].startswith("per_gpu::")]
    recorded.update(checks=per_gpu, planned=[c["nodeid"] for c in per_gpu])
    recorded["settings"]["select"] = "per_gpu"
    report = settled(recorded)
    assert report.exit_code == Exit.OK
    assert report.left_out() == ["host::dev_shm_is_large_enough", "gpus::torch_sees_the_expected_gpus",
                                 "gpus::gpus_have_what_they_should", "gpus::driver_supports_the_image_cuda",
                                 "gpus::every_gpu_computes"]
    assert ("# the selection left out 5 check(s) this tier promises, not proven here: "
            "host::dev_shm_is_large_enough, gpus::torch_sees_the_expected_gpus,") in report.table()


def test_a_run_where_every_check_skipped_is_not_ok(recorded):
    kept = copy.deepcopy([c for c in recorded["checks"] if c["name"].startswith("per_gpu::")])
    for check in kept:
        check.update(outcome="skipped", message="needs a CUDA GPU; this run is on CPU (gloo)")
    recorded.update(checks=kept, planned=[c["nodeid"] for c in kept], world={**recorded["world"], "backend": "gloo"})
    recorded["settings"]["select"] = "per_gpu"
    report = settled(recorded)
    assert report.exit_code == Exit.INCOMPLETE
    assert report.message == ("no check was judged: every check skipped, e.g. per_gpu::health_history: needs a "
                              "CUDA GPU; this run is on CPU (gloo)")


def test_spec_given_is_promised_on_every_host_and_tier():
    for tier, kind in verdict.PROMISES:
        assert "node_spec::matches_the_spec" in verdict.promises(tier, kind, {"spec": "s.json"})
        assert "node_spec::matches_the_spec" not in verdict.promises(tier, kind, {"spec": None})


def suite_checks() -> set[str]:
    """module::check of every test function in smoke_tests/, named as the report names them."""
    names = set()
    for path in Path(smoke_tests_dir()).glob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(Check(f"smoke_tests/{path.name}::{node.name}").name)
    return names


def test_every_promise_names_checks_of_the_suite():
    names = suite_checks()
    promises = {p for found in verdict.PROMISES.values() for p in found} | set(verdict.PROMISED_BY_SETTING.values())
    for promise in promises:
        assert any(verdict.covers(promise.split("[")[0], name) for name in names), promise


def test_k_per_gpu_on_a_cpu_host_does_not_exit_0(tmp_path):
    """The run of the issue: every selected check needs a GPU; CPU ranks judge none of them."""
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--nproc", "1", "-k", "per_gpu")
    assert proc.returncode == Exit.INCOMPLETE, proc.stdout[-3000:]
    assert report["message"].startswith("no check was judged: every check skipped, e.g. per_gpu::")
    assert "# Verdict: FAILED (exit code 4" in proc.stdout
