"""The node spec (stackproof/judge/spec.py, docs/spec.md): made from known-good reports, enforced per node,
and the nodes of a job compared without one. Judged from recorded report.json data (no torch, no GPU): the
H200 facts of tests/fixtures/spec/, with one fact at a time broken as NVML would report it. The CLI runs for
real: `stackproof spec` on the fixture and on a real CPU run, `validate --spec` refusing a bad file before any
rank starts and, on CPU, not passing a run whose GPUs it could not hold to the spec."""

import copy
import json
from pathlib import Path

import pytest
from test_validate_cpu import stackproof, validate

from stackproof.errors import ConfigError, Exit
from stackproof.judge import fabric, spec
from stackproof.measure import topology

FIXTURE = Path(__file__).parent / "fixtures" / "spec" / "h200x2-report.json"
H200 = {"gpu_count": 2, "gpu_model": "NVIDIA H200", "memory_total_mib": 143771, "nvlinks_up": 18, "pcie_gen": 5,
        "pcie_width": 16, "ecc_enabled": True, "persistence_mode": True, "mig_enabled": False,
        "driver_version": "580.159.04", "vbios_version": "96.00.A5.00.1A", "power_limit_w": 700.0}


@pytest.fixture
def good():
    return json.loads(FIXTURE.read_text())


@pytest.fixture
def made(good):
    return spec.make_spec({"good": good})


def rows_of(report):
    return copy.deepcopy(report["tables"][spec.TABLE])


def test_a_spec_is_what_the_known_good_runs_agree_on(made):
    assert made["schema"] == spec.SCHEMA
    (entry,) = made["entries"]
    assert entry["key"] == {"gpu": "NVIDIA H200", "gpus_per_node": 2}
    # The fixture's run predates the fabric facts: those fields are recorded as unknown, and never compared.
    assert entry["expect"] == {**H200, **fabric.node_facts(None)} and entry["reports"] == ["good"]
    assert spec.parse(json.loads(json.dumps(made)), "x") == made  # what it writes, it reads back


def test_a_healthy_node_matches_its_spec(made, good):
    assert spec.judge_spec(made, rows_of(good)) == []


@pytest.mark.parametrize(("field", "value", "found", "category", "severity"), [
    ("ecc_enabled", False, "off", "configuration", "reset"),
    ("persistence_mode", False, "off", "configuration", "triage"),
    ("mig_enabled", True, "on", "configuration", "reset"),
    ("vbios_version", "96.00.74.00.01", "96.00.74.00.01", "configuration", "triage"),
    ("power_limit_w", 500.0, "500", "configuration", "triage"),
    ("memory_total_mib", 143771 - 512, "143259", "gpu-hardware", "isolate"),
    ("nvlinks_up", 17, "17", "interconnect", "reset"),
    ("pcie_gen", 3, "3", "interconnect", "triage"),
    ("pcie_width", 8, "8", "interconnect", "triage"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_one_fact_off_the_spec_is_a_finding_on_that_gpu(made, good, field, value, found, category, severity):
    rows = rows_of(good)
    rows[1][field] = value
    (finding,) = spec.judge_spec(made, rows)
    assert (finding.gpu_index, finding.uuid) == (1, rows[1]["uuid"])
    assert finding.expected == spec._text(H200[field]) and finding.found == found
    assert (finding.category, finding.severity) == (category, severity) and finding.action
    assert spec.RULE[field].words in finding.check


def test_a_node_with_another_driver_is_a_node_finding(made, good):
    rows = rows_of(good)
    for row in rows:
        row["driver_version"] = "570.86.10"
    (finding,) = spec.judge_spec(made, rows)
    assert finding.gpu_index is None and (finding.expected, finding.found) == ("580.159.04", "570.86.10")
    assert finding.category == "configuration" and "install the spec's driver" in finding.action


def test_a_gpu_missing_from_the_node_is_named(made, good):
    (finding,) = spec.judge_spec(made, rows_of(good)[:1])
    assert "GPUs on the node" in finding.check and (finding.expected, finding.found) == ("2", "1")
    assert (finding.category, finding.severity) == ("gpu-hardware", "isolate")


def test_gpus_a_job_uses_that_the_run_skipped_count_as_there(made, good):
    """healthcheck --skip-busy-gpus on a node running a job on one of its 2 GPUs: the spec counts it (issue 25)."""
    assert spec.judge_spec(made, rows_of(good)[:1], skipped=1) == []
    assert spec.key_of(rows_of(good)[:1], skipped=1) == {"gpu": "NVIDIA H200", "gpus_per_node": 2}
    (finding,) = spec.judge_spec(made, rows_of(good)[:1], skipped=0)
    assert (finding.expected, finding.found) == ("2", "1")


def test_healthcheck_tells_the_run_which_gpus_it_skipped():
    from stackproof.act import hardware

    use = [hardware.GpuUse(0, "GPU-0", ()), hardware.GpuUse(1, "GPU-1", (4242,)), hardware.GpuUse(2, "GPU-2", (7,))]
    plan = hardware.idle_plan(use, expect_gpus=3)
    assert (plan.cuda_visible_devices, plan.expect_gpus, plan.skipped) == ("GPU-0", 1, "GPU-1,GPU-2")
    from stackproof.run.config import ValidateConfig

    assert ValidateConfig(skipped_gpus=plan.skipped).skipped_gpu_count == 2


def test_another_gpu_model_is_not_held_to_this_spec(made, good):
    rows = rows_of(good)
    for row in rows:
        row["gpu_model"] = "NVIDIA H100 80GB HBM3"
    (finding,) = spec.judge_spec(made, rows)
    assert finding.found == "NVIDIA H100 80GB HBM3" and "NVIDIA H200 x 2" in finding.expected


def test_a_reading_nvml_could_not_give_is_a_finding_naming_the_nvml_error(made, good):
    rows = rows_of(good)
    rows[0]["ecc_enabled"] = None
    rows[0]["nvml_errors"] = {"ECC mode": "NVML error Unknown Error"}
    (finding,) = spec.judge_spec(made, rows)
    assert finding.gpu_index == 0 and finding.found == "n/a (ECC mode: NVML error Unknown Error)"


def test_facts_of_a_gpu_with_readings_missing_do_not_break(made, good):
    """topology.Gpu as read_gpu leaves it when NVML answers NotSupported or fails: None, 0, errors kept."""
    gpu = topology.Gpu(index=0, name="NVIDIA H200", uuid="GPU-1", memory_total_bytes=143771 << 20,
                       nvml_errors={"VBIOS version": "NVML error GPU is lost"})
    row = spec.row_of(gpu, None, "n1", 0)
    assert row["pcie_gen"] is None and row["vbios_version"] is None and row["nvlinks_up"] == 0
    json.dumps(row)
    found = {f.check.removeprefix("node_spec "): f.found for f in spec.judge_spec(made, [row, rows_of(good)[1]])}
    assert found["VBIOS"] == "n/a (VBIOS version: NVML error GPU is lost)"
    assert found["NVLinks up"] == "0" and "NVIDIA driver" not in found  # the node's other GPU read the driver
    lost = spec.unread_row("n1", 1, "NVMLError_GpuIsLost: GPU is lost")
    assert spec.key_of([row, lost]) == {"gpu": "NVIDIA H200", "gpus_per_node": 2}
    compared = [rule for rule in spec.RULES if not rule.judged_by]
    assert len(spec.judge_spec(made, [rows_of(good)[0], lost])) == len(compared) - 2  # model/count fit


def test_a_null_field_of_the_spec_is_not_compared(made, good):
    made["entries"][0]["expect"]["power_limit_w"] = None
    rows = rows_of(good)
    rows[0]["power_limit_w"] = 300.0
    assert spec.judge_spec(made, rows) == []


def test_a_spec_refuses_failed_runs_cpu_runs_and_values_that_differ(good):
    failed = {**good, "verdict": "FAILED", "exit_code": 1, "message": "a check failed"}
    with pytest.raises(ConfigError, match=r"r1: field 'verdict': expected OK .* found 'FAILED' .*fix: leave"):
        spec.make_spec({"r1": failed})
    unfinished = {**good, "complete": False}  # says OK, but the run never wrote its final verdict
    with pytest.raises(ConfigError, match=r"r2: field 'complete': expected true \(a run that finished .*found "
                                          r"False: the run was still going or was stopped, verdict 'OK'"):
        spec.make_spec({"r2": unfinished})
    with pytest.raises(ConfigError, match=r"r3: field 'exit_code': expected 0"):
        spec.make_spec({"r3": {**good, "exit_code": 4}})
    cpu = {**good, "tables": {}}
    with pytest.raises(ConfigError, match=r"cpu: field 'tables.per_gpu_facts': expected each GPU's facts"):
        spec.make_spec({"cpu": cpu})
    other = copy.deepcopy(good)
    for row in other["tables"][spec.TABLE]:
        row["driver_version"] = "570.86.10"
    with pytest.raises(ConfigError) as err:
        spec.make_spec({"a.json": good, "b.json": other})
    said = str(err.value)
    assert "driver_version: 580.159.04 on h200-1 (a.json), 570.86.10 on h200-1 (b.json)" in said
    assert "fix: leave out the reports of the odd nodes" in said


def test_a_bad_spec_file_names_the_field(tmp_path, made):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**made, "schema": "stackproof.spec/0"}))
    assert "field 'schema': expected 'stackproof.spec/1', found 'stackproof.spec/0'" in spec.problem(str(path))
    broken = copy.deepcopy(made)
    broken["entries"][0]["expect"]["colour"] = "green"
    path.write_text(json.dumps(broken))
    assert "field 'entries[0].expect.colour': expected only the fields gpu_count," in spec.problem(str(path))
    path.write_text("{")
    assert "expected a node spec JSON made by `stackproof spec`" in spec.problem(str(path))
    path.write_text(json.dumps(made))
    assert spec.problem(str(path)) is None


def _set(path):
    """A change to a spec at a dotted path (entries.0.expect.gpu_count), as a function of the spec."""
    *parents, last = path.split(".")

    def change(made, value):
        target = made
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = value
    return change


JUNK = [  # (what is changed, its value, the field named, what is expected)
    ("entries.0.expect.gpu_count", "2", "entries[0].expect.gpu_count", "a whole number >= 1 or null"),
    ("entries.0.expect.gpu_count", True, "entries[0].expect.gpu_count", "a whole number >= 1 or null"),
    ("entries.0.expect.gpu_count", 3, "entries[0].expect.gpu_count", "the key's gpus_per_node (2) or null"),
    ("entries.0.expect.ecc_enabled", "yes", "entries[0].expect.ecc_enabled", "true or false or null"),
    ("entries.0.expect.memory_total_mib", -80, "entries[0].expect.memory_total_mib", "a whole number >= 1"),
    ("entries.0.expect.nvlinks_up", 1.5, "entries[0].expect.nvlinks_up", "a whole number >= 0"),
    ("entries.0.expect.power_limit_w", 0, "entries[0].expect.power_limit_w", "a number of watts > 0"),
    ("entries.0.expect.gpu_model", " ", "entries[0].expect.gpu_model", "a non-empty string or null"),
    ("entries.0.expect.driver_version", 580, "entries[0].expect.driver_version", "a non-empty string or null"),
    ("entries.0.expect.fabric_ports_up", "8", "entries[0].expect.fabric_ports_up", "a whole number >= 0 or null"),
    ("entries.0.expect.fabric_port_rate_gbps", "400 Gb/sec", "entries[0].expect.fabric_port_rate_gbps",
     "a number of Gb/s > 0 or null"),
    ("entries.0.expect", {}, "entries[0].expect", "at least one field that is not null"),
    ("entries.0.expect", dict.fromkeys(spec.FIELDS), "entries[0].expect", "at least one field that is not null"),
    ("entries.0.key.gpu", "", "entries[0].key", "an object with gpu (a model)"),
    ("entries.0.key.colour", "green", "entries[0].key.colour", "only the fields gpu, gpus_per_node"),
    ("entries.0.notes", "x", "entries[0].notes", "only the fields key, reports, expect"),
    ("owner", "me", "owner", "only the fields schema, stackproof, created, entries"),
]


@pytest.mark.parametrize(("where", "value", "field", "expected"), JUNK, ids=[f"{w}={v!r}" for w, v, *_ in JUNK])
def test_a_spec_of_the_wrong_types_or_values_is_refused_naming_the_field(tmp_path, made, where, value, field,
                                                                          expected):
    """Read as it is, "gpu_count": "2" would fail every node as 'expected 2, found 2' (gpu-hardware: drained),
    and an empty entry would pass every node with nothing compared: refused at load, naming the field."""
    broken = copy.deepcopy(made)
    _set(where)(broken, value)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(broken))
    said = spec.problem(str(path))
    assert said and f"field '{field}': expected {expected}" in said and "fix: " in said, said


def test_a_spec_made_from_a_node_with_rdma_ports_is_read_back(tmp_path, good):
    """Issue 36 item 1: `spec` wrote fabric_ports_up 8 and fabric_port_rate_gbps 400.0, and `validate --spec`
    refused its own output (a text was expected)."""
    for row in good["tables"][spec.TABLE]:
        row.update(fabric_ports_up=8, fabric_port_rate_gbps=400.0, fabric_link_layer="InfiniBand")
    made = spec.make_spec({"good": good})
    assert made["entries"][0]["expect"]["fabric_ports_up"] == 8
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(made))
    assert spec.problem(str(path)) is None


def test_a_spec_with_nan_or_a_duplicate_entry_is_refused(tmp_path, made):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(made).replace("700.0", "NaN"))
    assert "found NaN, which is not a number (JSON has no NaN or Infinity)" in spec.problem(str(path))
    twice = copy.deepcopy(made)
    twice["entries"].append(copy.deepcopy(twice["entries"][0]))
    path.write_text(json.dumps(twice))
    assert ("field 'entries[1].key': expected one entry per key (entries[0] is also NVIDIA H200 x 2)"
            in spec.problem(str(path)))


def test_a_missing_spec_says_so_and_the_fix_without_an_exception_name(tmp_path):
    said = spec.problem(str(tmp_path / "nope.json"))
    assert said.endswith("nope.json: expected a node spec JSON made by `stackproof spec`, found no such file; fix: "
                         "name the file `stackproof spec REPORT... -o FILE` wrote (make one from known-good runs: "
                         "docs/spec.md)"), said
    assert "Error" not in said


def nodes(good, drivers, vbios=None):
    """Facts of len(drivers) nodes like the fixture's, node n<i> with drivers[i]."""
    found = {}
    for i, driver in enumerate(drivers, 1):
        rows = rows_of(good)
        for row in rows:
            row.update(node=f"n{i}", driver_version=driver, uuid=f"{row['uuid']}-n{i}")
        found[f"n{i}"] = rows
    for (node, gpu), version in (vbios or {}).items():
        found[node][gpu]["vbios_version"] = version
    return found


def test_two_nodes_with_different_drivers_are_both_named(good):
    """n2's driver differs; with two nodes neither is the majority, so both are named."""
    odd = spec.odd_nodes(nodes(good, ["580.159.04", "570.86.10"]))
    assert sorted(odd) == ["n1", "n2"]
    (finding,) = odd["n2"]
    assert finding.found == "570.86.10" and "a tie: 580.159.04 on n1" in finding.expected
    assert finding.gpu_index is None and finding.category == "configuration"


def test_the_node_off_the_majority_driver_is_named_alone(good):
    odd = spec.odd_nodes(nodes(good, ["580.159.04", "570.86.10", "580.159.04"]))
    assert list(odd) == ["n2"]
    assert odd["n2"][0].expected == "the driver of the other nodes (580.159.04)"


def test_a_gpu_off_its_models_vbios_is_named_with_its_index(good):
    odd = spec.odd_nodes(nodes(good, ["580.159.04"] * 2, vbios={("n2", 1): "96.00.74.00.01"}))
    (finding,) = odd["n2"]
    assert finding.gpu_index == 1 and finding.found == "96.00.74.00.01"
    assert finding.expected == "the VBIOS of the other NVIDIA H200 GPUs (96.00.A5.00.1A)"


def test_nodes_that_agree_and_a_lone_node_name_nobody(good):
    assert spec.odd_nodes(nodes(good, ["580.159.04"] * 3)) == {}
    assert spec.odd_nodes(nodes(good, ["570.86.10"])) == {}


# The command line, for real.

def test_spec_command_writes_a_spec_and_refuses_to_overwrite_a_report(tmp_path):
    out = tmp_path / "spec.json"
    made = stackproof("spec", FIXTURE, "-o", out)
    assert made.returncode == 0, made.stderr
    assert spec.load(out)["entries"][0]["expect"] == {**H200, **fabric.node_facts(None)}
    assert "# NVIDIA H200 x 2: from 1 report(s): gpu_count=2" in made.stdout
    copied = tmp_path / "r" / "report.json"
    copied.parent.mkdir()
    copied.write_text(FIXTURE.read_text())
    disguised = tmp_path / "x.json"
    disguised.write_text(FIXTURE.read_text())
    for target, found in ((tmp_path, "found a folder"), (copied, "found a run's report.json"),
                          (disguised, "found a run's report.json (overwriting it would lose the run)")):
        refused = stackproof("spec", FIXTURE, "-o", target)
        assert refused.returncode == Exit.USAGE and found in refused.stderr, refused.stderr
        assert "fix: name another file, e.g. -o spec.json" in refused.stderr
    assert json.loads(disguised.read_text())["schema"] == "stackproof.report/2"


def test_validate_spec_on_cpu_cannot_judge_it_says_so_and_its_report_makes_no_spec(tmp_path):
    """A CPU run cannot hold a node to a spec of GPUs: the check needs a GPU (its declaration), so the run does not
    promise it and says why it skipped (issue 33: a configuration that cannot run a check does not promise it).
    And a real CPU run's report has no GPU facts to make a spec from."""
    assert stackproof("spec", FIXTURE, "-o", tmp_path / "spec.json").returncode == 0
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--nproc", "1", "--spec", tmp_path / "spec.json",
                            "-k", "dev_shm or node_spec")
    assert proc.returncode == Exit.OK, proc.stdout[-3000:]
    spec_check = next(c for c in report["checks"] if c["name"] == "node_spec::matches_the_spec")
    assert spec_check["outcome"] == "skipped" and spec_check["message"] == "needs a CUDA GPU; this run is on CPU (gloo)"
    assert not any("matches_the_spec" in nodeid for nodeid in report["promised"])
    refused = stackproof("spec", tmp_path / "reports", "-o", tmp_path / "again.json")
    assert refused.returncode == Exit.USAGE and "Traceback" not in refused.stderr
    assert "field 'tables.per_gpu_facts': expected each GPU's facts" in refused.stderr
    assert not (tmp_path / "again.json").exists()


def test_validate_refuses_a_bad_spec_before_any_rank_starts(tmp_path, made):
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "stackproof.spec/1", "entries": []}))
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--spec", tmp_path / "bad.json")
    assert proc.returncode == Exit.USAGE and report is None
    assert "--spec" in proc.stderr and "field 'entries': expected a non-empty list" in proc.stderr
    assert "Traceback" not in proc.stderr
    made["entries"][0]["expect"]["gpu_count"] = "2"
    (tmp_path / "typed.json").write_text(json.dumps(made))
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--spec", tmp_path / "typed.json")
    assert proc.returncode == Exit.USAGE and report is None
    assert "field 'entries[0].expect.gpu_count': expected a whole number >= 1 or null, found '2'" in proc.stderr


def test_a_spec_from_runs_without_nvml_readings_says_what_it_will_not_hold(tmp_path, good):
    """power_limit_w null is 'not compared', a model NVML did not name is 'unknown': made without a word,
    such a spec would later pass nodes it cannot judge."""
    for row in good["tables"][spec.TABLE]:
        row["power_limit_w"] = row["vbios_version"] = row["gpu_model"] = None
        row["nvml_errors"] = {"power limit": "NVMLError_NotSupported"}
    (tmp_path / "report.json").write_text(json.dumps(good))
    made = stackproof("spec", tmp_path, "-o", tmp_path / "spec.json")
    assert made.returncode == 0, made.stderr
    assert ("stackproof: warning: unknown x 2: the known-good runs have no reading of gpu_model, vbios_version, "
            "power_limit_w (NVML gave none): this spec will not hold nodes to them (null: not compared); fix: ") \
        in made.stderr
    assert "unknown x 2: the known-good runs have no GPU model (NVML gave no name)" in made.stderr
    assert "warning" not in stackproof("spec", FIXTURE, "-o", tmp_path / "full.json").stderr
