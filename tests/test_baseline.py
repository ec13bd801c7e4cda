"""Baselines for real: known-good CPU runs (gloo) make a baseline with `stackproof baseline`, and later runs with
`validate --baseline` pass or fail against it. CPU timings on a busy machine are noisy, so the failing case holds
a figure to a baseline far out of reach and the passing case uses a generous tolerance."""

import json
import time

import pytest
from test_validate_cpu import EXIT_FAILED, EXIT_OK, checks, stackproof, validate

from stackproof.errors import Exit

# The bandwidth sweep (GB/s, higher is better) and the barrier (ms, lower is better): two directions, short runs.
FIGURES = ["--sweep-max", "256K", "-k", "busbw or barrier or baseline"]
BASELINE_CHECK = "baseline::figures_hold_their_baseline"
SWEEP = "bandwidth::all_reduce_busbw"


@pytest.fixture(scope="module")
def known_good(tmp_path_factory):
    """A real passing run and the baseline made from it."""
    tmp = tmp_path_factory.mktemp("known_good")
    proc, report = validate(tmp, "--expect-gpus", "0", *FIGURES)
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no --baseline given" in checks(report, "skipped")[BASELINE_CHECK]["message"]
    made = stackproof("baseline", tmp / "reports", "-o", tmp / "baseline.json")
    assert made.returncode == 0, made.stderr
    return tmp / "reports", tmp / "baseline.json", made.stdout


def test_a_baseline_is_the_median_per_figure_and_key(known_good):
    reports, path, said = known_good
    made = json.loads(path.read_text())
    assert made["schema"] == "stackproof.baseline/1"
    (entry,) = made["entries"]
    assert entry["key"] == {"gpu": "cpu", "ranks_per_node": 2, "nodes": 1, "link": ""}
    report = {c["name"]: c for c in json.loads((reports / "report.json").read_text())["checks"]}
    # Both ranks report the sweep's (rank-averaged) figure: two samples, one value.
    assert entry["figures"][SWEEP]["busbw@256KiB"] == {
        "median": report[SWEEP]["figures"]["busbw@256KiB"]["value"], "unit": "GB/s", "better": "higher",
        "samples": 2}
    barrier = report["collectives::barrier"]
    mine = [barrier["figures"], barrier["rank_figures"].get("1", barrier["figures"])]
    assert entry["figures"]["collectives::barrier"]["barrier"] == {
        "median": pytest.approx(sum(f["barrier"]["value"] for f in mine) / 2), "unit": "ms", "better": "lower",
        "samples": 2}
    assert f"{reports}: cpu, 2 rank(s)/node, 1 node(s)" in said


def test_a_figure_far_below_its_baseline_fails_naming_it(known_good, tmp_path):
    _, path, _ = known_good
    far = json.loads(path.read_text())
    far["entries"][0]["figures"][SWEEP]["busbw@256KiB"]["median"] = 1e6  # out of any CPU's reach
    (tmp_path / "far.json").write_text(json.dumps(far))
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--baseline", tmp_path / "far.json",
                            "--baseline-tolerance", "0.05", *FIGURES)
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:]
    failed = checks(report, "failed")[BASELINE_CHECK]
    message = failed["message"]
    assert "bandwidth::all_reduce_busbw busbw@256KiB: found" in message and "baseline 1e+06 GB/s" in message
    assert "higher is better" in message and "tolerance 5%" in message and "on rank 1 on " in message
    assert failed["failed_ranks"] == [0, 1] and failed["category"] == "performance"
    assert report["nodes"][0]["verdict"] == "FAIL"
    assert BASELINE_CHECK in [f["check"] for f in report["nodes"][0]["failed_checks"]]
    assert "# Verdict: FAILED" in proc.stdout
    # A failing run is refused as a baseline, naming the file and the field.
    refused = stackproof("baseline", tmp_path / "reports", "-o", tmp_path / "nope.json")
    assert refused.returncode == Exit.USAGE and not (tmp_path / "nope.json").exists()
    assert f"{tmp_path / 'reports' / 'report.json'}: field 'verdict': expected OK" in refused.stderr
    assert "failing runs" in refused.stderr


def test_a_run_within_its_baseline_passes(known_good, tmp_path):
    _, path, _ = known_good
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--baseline", path, "--baseline-tolerance", "1000",
                            *FIGURES)
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    held = checks(report, "passed")[BASELINE_CHECK]
    assert held["figures"]["compared"]["value"] >= 4  # busbw and barrier, on both ranks
    assert held["figures"]["key"]["value"] == "cpu, 2 rank(s)/node, 1 node(s)"


def test_another_topology_skips_and_keys_are_named_when_mixed(known_good, tmp_path):
    reports, path, _ = known_good
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--nproc", "1", "--baseline", path,
                            "-k", "barrier or baseline")
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    skip = checks(report, "skipped")[BASELINE_CHECK]["message"]
    assert "has no entry for this run (cpu, 1 rank(s)/node, 1 node(s))" in skip
    assert "it has: cpu, 2 rank(s)/node, 1 node(s)" in skip
    made = stackproof("baseline", reports, tmp_path / "reports", "-o", tmp_path / "both.json")
    assert made.returncode == 0, made.stderr
    assert f"# {reports}: cpu, 2 rank(s)/node" in made.stdout
    assert f"# {tmp_path / 'reports'}: cpu, 1 rank(s)/node" in made.stdout
    assert len(json.loads((tmp_path / "both.json").read_text())["entries"]) == 2


def test_another_schema_is_refused_naming_the_field(known_good, tmp_path):
    reports, _, _ = known_good
    other = json.loads((reports / "report.json").read_text()) | {"schema": "stackproof.report/0"}
    (tmp_path / "old.json").write_text(json.dumps(other))
    refused = stackproof("baseline", reports, tmp_path / "old.json", "-o", tmp_path / "b.json")
    assert refused.returncode == Exit.USAGE
    assert f"{tmp_path / 'old.json'}: field 'schema': expected 'stackproof.report/1', found 'stackproof.report/0'" \
        in refused.stderr


@pytest.mark.parametrize(("content", "words"), [
    ("not json", "expected a baseline JSON"),
    ('{"schema": "stackproof.baseline/1", "entries": []}', "field 'entries': expected a non-empty list"),
    ('{"schema": "stackproof.baseline/1", "entries": [{"key": {"gpu": "cpu", "ranks_per_node": 2, "nodes": 1, '
     '"link": ""}, "figures": {"c": {"f": {"median": "fast", "unit": "GB/s"}}}}]}',
     "field 'entries[0].figures[c][f]'.median: expected a number, found 'fast'"),
])
def test_a_bad_baseline_file_is_exit_2_before_anything_runs(tmp_path, content, words):
    (tmp_path / "b.json").write_text(content)
    started = time.monotonic()
    proc, report = validate(tmp_path, "--expect-gpus", "0", "--baseline", tmp_path / "b.json")
    assert proc.returncode == Exit.USAGE and report is None
    assert words in proc.stderr and str(tmp_path / "b.json") in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 30  # no rank started


def test_a_tolerance_must_be_positive(tmp_path, known_good):
    proc, _ = validate(tmp_path, "--baseline", known_good[1], "--baseline-tolerance", "0")
    assert proc.returncode == Exit.USAGE and "--baseline-tolerance: expected > 0, found 0" in proc.stderr


def gpu_report(hbm0=4.238, hbm1=4.235, transport=True):
    """report.json's shape on 2 GPUs (docs/report-format.md): rank 0 holds every GPU's figure as name@host:gpu,
    rank 1 its own; the bar is a derived figure."""
    gpu = {"name": "NVIDIA H200", "uuid": "GPU-x", "serial": "1654", "pci_bus_id": "0000:00:06.0"}
    return {"schema": "stackproof.report/1", "verdict": "OK", "exit_code": 0, "complete": True,
            "world": {"size": 2, "nodes": 1, "backend": "nccl", "local_world_size": 2},
            "ranks": [{"rank": r, "node": "n1", "host": "n1", "gpu": {**gpu, "index": r}} for r in (0, 1)],
            "context": {"nccl_transport": {"nvlink_up": True}} if transport else {
                "busbw_threshold": {"gbps": 30.0, "source": "0.5 x 63.0 GB/s peak (PCIe gen5 x16)"}},
            "checks": [{"name": "per_gpu::hbm_bandwidth", "verdict": "PASS",
                        "figures": {"hbm@n1:0": {"value": hbm0, "unit": "TB/s"},
                                    "hbm@n1:1": {"value": hbm1, "unit": "TB/s"},
                                    "hbm_bar": {"value": 3.37, "unit": "TB/s"}},
                        "rank_figures": {"1": {"hbm": {"value": hbm1, "unit": "TB/s"}}}}]}


def test_per_gpu_figures_are_each_ranks_own_and_bars_are_left_out():
    from stackproof.suite import baseline

    per_rank = baseline.per_rank_figures(gpu_report())
    assert per_rank == {0: {"per_gpu::hbm_bandwidth": {"hbm": {"value": 4.238, "unit": "TB/s"}}},
                        1: {"per_gpu::hbm_bandwidth": {"hbm": {"value": 4.235, "unit": "TB/s"}}}}
    assert baseline.key_of(gpu_report()) == {"gpu": "NVIDIA H200", "ranks_per_node": 2, "nodes": 1, "link": "NVLink"}
    assert baseline.key_of(gpu_report(transport=False))["link"] == "PCIe"
    entry = {"figures": {"per_gpu::hbm_bandwidth": {"hbm": {"median": 4.2, "unit": "TB/s", "samples": 2}}}}
    compared, worse = baseline.regressions(gpu_report(hbm1=3.9), entry, 0.05)
    assert compared == 2 and list(worse) == [1] and "found 3.9 TB/s, baseline 4.2 TB/s" in worse[1][0]
    assert baseline.worse(1.06, 1.0, "lower", 0.05) and not baseline.worse(1.04, 1.0, "lower", 0.05)
