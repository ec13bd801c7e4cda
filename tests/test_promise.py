"""No PASS without a judgement (stackproof/judge/promise.py): what a run promises is derived from each check's own
declaration, so a configuration that cannot run a check does not promise it, and one that can and skipped it is
exit 4. Judged as pure functions over the suite's real declarations (collected from smoke_tests/ by a real run)
and over recorded reports of healthy runs: 1 x H200 (full, fast, burn: the configuration that failed with exit 4
before the declarations), 2 x H200 (fast), two emulated nodes on one H200, and CPU ranks."""

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_validate_cpu import validate

from stackproof.errors import ConfigError, Exit
from stackproof.judge import promise
from stackproof.judge.promise import FAST, FULL, SOAK, Declaration, Needs, World
from stackproof.report import terminal
from stackproof.report.record import Report

FIXTURES = Path(__file__).parent / "fixtures" / "promise"
H200X2 = Path(__file__).parent / "fixtures" / "spec" / "h200x2-report.json"
HBM = "smoke_tests/test_02_per_gpu.py::test_hbm_bandwidth"
SEND_RECV = "test_04_collectives.py::test_send_recv_between_every_pair[float32]"
ALL = {}


def api(name: str) -> bool:
    return name != "torch.missing"


# --- the declaration, pure ---------------------------------------------------------------------------------------

def test_needs_say_which_need_a_run_lacks():
    one_gpu = World(size=1, nodes=1, local_size=1, gpu=True)
    assert Needs().unmet(one_gpu, ALL, api) is None
    assert Needs(ranks=2).unmet(one_gpu, ALL, api) == "needs 2+ ranks; this run has 1"
    assert Needs(gpu=True).unmet(World(size=2, local_size=2), ALL, api) == \
        "needs a CUDA GPU; this run is on CPU (gloo)"
    assert Needs(nodes=2).unmet(World(size=8, local_size=8, gpu=True), ALL, api) == \
        "needs 2+ nodes; this run has 1"
    assert Needs(local_ranks=2).unmet(World(size=2, nodes=2, local_size=1, gpu=True), ALL, api) == \
        "needs 2+ ranks on one node; this run has 1 per node"
    assert Needs(setting="spec").unmet(one_gpu, {"spec": None}, api) == \
        "needs --spec: nothing asks for this check here"
    assert Needs(setting="spec").unmet(one_gpu, {"spec": "s.json"}, api) is None
    assert Needs(api="torch.missing").unmet(one_gpu, ALL, api) == "needs torch.missing, which this torch does not have"


def test_a_declaration_promises_what_its_tier_can_judge_unless_optional():
    cpu, gpu = World(size=2, local_size=2), World(size=2, local_size=2, gpu=True)
    assert Declaration(FAST).promised("full", cpu, ALL, api) and Declaration(FAST).promised("burn", cpu, ALL, api)
    assert not Declaration(FULL).promised("fast", cpu, ALL, api)
    assert not Declaration(SOAK).promised("full", cpu, ALL, api) and Declaration(SOAK).promised("burn", cpu, ALL, api)
    gloo = Declaration(FULL, Needs(), optional="gloo's averaging", optional_on=("cpu",))
    assert not gloo.promised("full", cpu, ALL, api) and gloo.promised("full", gpu, ALL, api)
    sag = Declaration(SOAK, optional="shared cores", optional_on=("cpu",), promised_by="burn_sag")
    assert not sag.promised("burn", cpu, {"burn_sag": None}, api) and sag.promised("burn", cpu, {"burn_sag": .1}, api)
    round_trip = Declaration(FULL, Needs(gpu=True, ranks=2), optional="why", optional_on=("cpu",), promised_by="x")
    assert Declaration.from_json(json.loads(json.dumps(round_trip.to_json()))) == round_trip
    older = {"tiers": ["full"], "fails_as": ["interconnect", "isolate"]}  # a report from before: read past
    assert Declaration.from_json(older) == Declaration(FULL)


def test_a_declaration_of_no_known_tier_is_refused():
    with pytest.raises(ConfigError, match="expected tiers among"):
        Declaration(("nightly",))
    with pytest.raises(ConfigError, match="found no tier"):
        Declaration(())
    with pytest.raises(TypeError):  # what a failure means is its findings', declared nowhere else
        Declaration(FAST, fails_as=("performance", "triage"))


# --- the suite's own declarations --------------------------------------------------------------------------------

def test_every_check_of_the_suite_hands_over_its_judgement_and_none_asserts():
    """A check's one interface (run/plugin.py pytest_pyfunc_call): its findings, returned in a Judged, carry what a
    failure means. An assert in a check would say it nowhere (unclassified): none is left, and a new one fails
    here. A check that only measures (the barrier: its failure is a hang or an exception) returns nothing."""
    asserting, judging = [], 0
    for path in sorted((Path(__file__).parent.parent / "smoke_tests").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            inner = list(ast.walk(node))
            judging += any(isinstance(n, ast.Return) and n.value is not None for n in inner)
            asserting += [f"{path.name}::{node.name}" for n in inner if isinstance(n, ast.Assert)
                          or (isinstance(n, ast.Raise) and "AssertionError" in ast.unparse(n))
                          or (isinstance(n, ast.Call) and ast.unparse(n.func) == "pytest.fail")]
    assert asserting == [] and judging >= 60, (asserting, judging)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every smoke test's declaration, as a real run collects them (one CPU rank, nothing run)."""
    proc, report = validate(tmp_path_factory.mktemp("collect"), "--nproc", "1", "--", "--collect-only")
    assert report and report["declarations"], proc.stdout[-3000:] + proc.stderr[-3000:]
    return {nodeid: Declaration.from_json(d) for nodeid, d in report["declarations"].items()}


def promised_names(suite, tier, world, settings=ALL):
    return {nodeid.split("::", 1)[1].split("[")[0] for nodeid in promise.promised(suite, tier, world, settings)}


WORLDS = {f"{gpus} GPU(s) x {nodes} node(s)": World(size=gpus * nodes, nodes=nodes, local_size=gpus, gpu=True)
          for gpus in (1, 2, 8) for nodes in (1, 2)}
WORLDS.update({f"{ranks} CPU rank(s) x {nodes} node(s)": World(size=ranks * nodes, nodes=nodes, local_size=ranks)
               for ranks in (1, 2, 4) for nodes in (1, 2)})


@pytest.mark.parametrize("tier", promise.TIERS)
@pytest.mark.parametrize("name", WORLDS)
def test_a_world_promises_only_what_it_can_judge(suite, name, tier):
    """The promise matrix: 1, 2 and 8 GPUs and CPU ranks x 1 and 2 nodes x every tier."""
    world = WORLDS[name]
    names = promised_names(suite, tier, world)
    assert "test_dev_shm_is_large_enough" in names  # every tier, every host
    pairs = ("test_send_recv_between_every_pair" in names, "test_no_gpu_lags_its_peers" in names)
    assert pairs == (tier == "full" and world.size >= 2, tier == "burn" and world.gpu and world.size >= 2)
    assert ("test_nodes_agree_on_driver_and_vbios" in names) == (world.gpu and world.nodes >= 2)
    assert ("test_hbm_bandwidth" in names) == world.gpu
    assert ("test_barrier" in names) == (tier == "full")
    assert ("test_clocks_and_temperature_hold" in names) == (tier == "burn" and world.gpu)
    # Never promised: a healthy machine may lack their bar.
    assert not names & {"test_gemm_throughput", "test_all_reduce_busbw", "test_node_pairs", "test_local_pairs",
                        "test_versions_match_the_promise", "test_figures_hold_their_baseline"}
    assert ("test_matches_the_spec" in promised_names(suite, tier, world, {"spec": "s.json"})) == world.gpu
    assert "test_matches_the_spec" not in names


def test_every_smoke_test_is_declared_and_none_names_an_unknown_setting(suite):
    from stackproof.run.config import ValidateConfig

    fields = set(ValidateConfig().to_json())
    for nodeid, declared in suite.items():
        for setting in (declared.needs.setting, declared.promised_by):
            assert not setting or setting in fields, (nodeid, setting)


# --- recorded healthy runs: exit 0 -------------------------------------------------------------------------------

RECORDED = sorted(FIXTURES.glob("*.json"))


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_a_recorded_healthy_run_is_ok_under_the_suites_declarations(suite, path):
    """Each recorded run's checks, judged with what the suite's declarations promise for its world and tier: a
    check a healthy configuration skips must not be promised there."""
    data = json.loads(path.read_text())
    world = World.from_record(data["world"])
    data["promised"] = promise.promised(suite, data["settings"]["tier"], world, data["settings"])
    report = Report.from_json(data)
    assert report.exit_code == Exit.OK, (report.message, report.unjudged())


def test_the_one_gpu_full_tier_that_failed_before_is_ok():
    """The issue's run: 1 x H200, full tier, send/recv skipped for want of a pair (exit 4 under the old table)."""
    data = json.loads((FIXTURES / "h200x1-full.json").read_text())
    skipped = {c["nodeid"]: c["message"] for c in data["checks"] if c["outcome"] == "skipped"}
    assert skipped[SEND_RECV] == "needs 2+ ranks; this run has 1"
    report = Report.from_json(data)
    assert SEND_RECV not in report.promised and report.exit_code == Exit.OK


# --- a promised check unjudged -----------------------------------------------------------------------------------

@pytest.fixture
def recorded():
    """A 2 x H200 fast-tier run, its promise derived from the suite's declarations for its world."""
    return json.loads(H200X2.read_text())


@pytest.fixture
def h200x2(recorded, suite):
    """Recorded when pytest's rootdir was the repository's: its node ids start with smoke_tests/."""
    ours = promise.promised(suite, "fast", World.from_record(recorded["world"]), recorded["settings"])
    recorded["promised"] = [f"smoke_tests/{nodeid}" for nodeid in ours]
    return recorded


def skip(data, nodeid, reason):
    check = next(c for c in data["checks"] if c["nodeid"] == nodeid)
    check.update(outcome="skipped", verdict="SKIP", message=reason)


def test_a_promised_check_that_skipped_is_not_ok(h200x2):
    assert Report.from_json(copy.deepcopy(h200x2)).exit_code == Exit.OK
    skip(h200x2, HBM, "no bar: NVML reports no memory bus width for this GPU")
    report = Report.from_json(h200x2)
    assert report.exit_code == Exit.INCOMPLETE
    assert report.message == ("not judged: per_gpu::hbm_bandwidth: skipped: no bar: NVML reports no memory bus "
                              "width for this GPU (tier fast on this GPU run promises these, by their declarations: "
                              "docs/report-format.md)")
    data = report.to_json()
    assert data["verdict"] == "FAILED" and data["promise"]["not_judged"] == [report.unjudged()[0]]
    assert "# Verdict: FAILED (exit code 4" in terminal.table(report) and "# not judged: per_gpu::hbm_bandwidth" in \
        terminal.table(report)


def test_a_failure_is_said_before_what_was_not_judged(h200x2):
    skip(h200x2, HBM, "no bar")
    failed = next(c for c in h200x2["checks"] if c["name"] == "per_gpu::sdc_digest")
    failed.update(outcome="failed", verdict="FAIL", failed_ranks=[1], message="digest differs")
    assert Report.from_json(h200x2).exit_code == Exit.FAILED


def test_k_narrows_the_promise_and_names_what_it_left_out(h200x2):
    per_gpu = [c for c in h200x2["checks"] if c["name"].startswith("per_gpu::")]
    h200x2.update(checks=per_gpu, planned=[c["nodeid"] for c in per_gpu])
    h200x2["settings"]["select"] = "per_gpu"
    report = Report.from_json(h200x2)
    assert report.exit_code == Exit.OK
    assert report.left_out()[:3] == ["host::dev_shm_is_large_enough", "gpus::torch_sees_the_expected_gpus",
                                     "gpus::gpus_have_what_they_should"]
    assert "# the selection left out" in terminal.table(report)


def test_a_report_written_before_the_declarations_keeps_its_verdict(recorded):
    """A schema-2 report of the older stackproof (no `promised`): what it said it did not judge still holds."""
    recorded["promise"] = {"not_judged": ["per_gpu::hbm_bandwidth: skipped: no bar"]}
    recorded["message"] = "not judged: per_gpu::hbm_bandwidth: skipped: no bar"
    assert Report.from_json(recorded).exit_code == Exit.INCOMPLETE


def test_a_run_where_every_check_skipped_is_not_ok(h200x2):
    kept = copy.deepcopy([c for c in h200x2["checks"] if c["name"].startswith("per_gpu::")])
    for check in kept:
        check.update(outcome="skipped", message="needs a CUDA GPU; this run is on CPU (gloo)")
    h200x2.update(checks=kept, planned=[c["nodeid"] for c in kept], promised=[])
    report = Report.from_json(h200x2)
    assert report.exit_code == Exit.INCOMPLETE
    assert report.message == ("no check was judged: every check skipped, e.g. per_gpu::health_history: needs a "
                              "CUDA GPU; this run is on CPU (gloo)")


# --- for real ----------------------------------------------------------------------------------------------------

def test_k_per_gpu_on_a_cpu_host_does_not_exit_0(tmp_path):
    """Every selected check needs a GPU; CPU ranks judge none of them."""
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--nproc", "1", "-k", "per_gpu")
    assert proc.returncode == Exit.INCOMPLETE, proc.stdout[-3000:]
    assert report["message"].startswith("no check was judged: every check skipped, e.g. per_gpu::")
    assert "# Verdict: FAILED (exit code 4" in proc.stdout


BARE = """import pytest
from stackproof.judge.promise import FAST, Needs

@pytest.fixture
def reading():
    pytest.fail("NVML could not read the GPU")

@pytest.mark.check(FAST, Needs())
def test_says_nothing_of_its_failure():
    assert 1 > 2, "something off"

@pytest.mark.check(FAST, Needs())
def test_its_reading_failed(reading):
    pass
"""


def test_a_bare_assertion_is_unclassified(tmp_path):
    """An assertion no judge step made (an assert in a test, a fixture's pytest.fail) says nothing of the machine:
    unclassified, an alert, never a drain."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_01_bare.py").write_text(BARE)
    proc, report = validate(tmp_path, "--nproc", "1", "-k", "bare", "--", str(suite))
    assert proc.returncode == Exit.FAILED, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = {check["name"]: [(f["category"], f["severity"], f["found"]) for f in check["findings"]]
             for check in report["checks"]}
    assert found == {"bare::says_nothing_of_its_failure": [("unclassified", "triage", "something off")],
                     "bare::its_reading_failed": [("unclassified", "triage",
                                                   "Failed: NVML could not read the GPU")]}, found


JUDGED = """import pytest
from stackproof.judge.findings import Finding, Judged
from stackproof.judge.promise import FAST, Needs

LINK = Finding(0, "GPU-1", "NVLink", "18 links up", "17", "interconnect", "reset", "reseat the bridge")

@pytest.mark.check(FAST, Needs())
def test_finds_a_link_down():
    return Judged([LINK], hint="nvidia-smi nvlink -s shows it", where="node n1")

@pytest.mark.check(FAST, Needs())
def test_finds_nothing():
    return Judged([], hint="never printed")

@pytest.mark.check(FAST, Needs())
def test_returns_what_no_check_returns():
    return 3
"""


def test_a_check_returns_its_judgement_and_the_runner_hands_it_over(tmp_path):
    """A check's one interface: it returns its judge step's Judged, and the runner records the hint and the
    findings (their class decides) and fails the check with them; nothing found passes; any other return is
    the tool's own error, never a pass."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_01_judged.py").write_text(JUDGED)
    proc, report = validate(tmp_path, "--nproc", "1", "-k", "judged", "--", str(suite))
    assert proc.returncode == Exit.FAILED, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = {check["name"]: check for check in report["checks"]}
    down = checks["judged::finds_a_link_down"]
    assert down["outcome"] == "failed" and down["hint"] == "nvidia-smi nvlink -s shows it", down
    assert [(f["category"], f["severity"], f["found"]) for f in down["findings"]] == [("interconnect", "reset", "17")]
    assert down["message"].startswith("node n1: GPU 0 GPU-1: NVLink: expected 18 links up, found 17"), down["message"]
    assert checks["judged::finds_nothing"]["outcome"] == "passed"
    odd = checks["judged::returns_what_no_check_returns"]
    assert odd["outcome"] == "failed" and [f["category"] for f in odd["findings"]] == ["tool-error"], odd
    assert "returns stackproof.judge.findings.Judged or nothing, found int" in odd["message"], odd["message"]


def test_an_undeclared_smoke_test_is_refused(tmp_path):
    """A check without a declaration cannot be promised or left out: refused at collection, exit 2."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_01_new.py").write_text("def test_undeclared():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--nproc", "1", "--reports",
                           str(tmp_path / "r"), "--", str(suite)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == Exit.USAGE, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "expected a declaration, found none" in proc.stdout + proc.stderr
