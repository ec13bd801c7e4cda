"""The burn-in tier run for real on CPU ranks (gloo, small CPU GEMMs, the same code path as on a GPU): a healthy
short soak passes, with its series in report.json and one progress line per 10 s at most on stdout; faults that
appear only after seconds of sustained load, patched into torch from outside the suite
(tests/fault_plugins/burn_faults.py), fail it naming the rank and the second. The thermal fault needs NVML, so it
is proved in tests/test_burn_units.py (a fake NVML beneath the sampler) and on the GPU machine
(tests/fault_plugins/prove_burn.sh)."""

import re
import sys
from pathlib import Path

from test_validate_cpu import EXIT_FAILED, EXIT_OK, assert_stdout_is_the_contract, checks, validate

PLUGINS = Path(__file__).parent / "fault_plugins"
REPO = Path(__file__).parent.parent
SOAK = "5"


def test_a_healthy_short_soak_passes_and_records_its_series(tmp_path):
    proc, report = validate(tmp_path, "--nproc", "2", "--tier", "burn", "--burn-seconds", SOAK)
    assert proc.returncode == EXIT_OK, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_stdout_is_the_contract(proc.stdout, "OK")
    passed = checks(report, "passed")
    assert {"burn::gemms_give_known_answers_throughout", "burn::memory_and_copies_hold_their_data"} <= set(passed)
    skipped = checks(report, "skipped")
    assert "judged only with --burn-sag" in skipped["burn::throughput_holds_over_time"]["message"]
    series = report["tables"]["burn_series"]
    assert sorted({row["rank"] for row in series}) == [0, 1]
    assert [row["t"] for row in series if row["rank"] == 1] == list(range(1, int(SOAK) + 1))
    for rank in (0, 1):  # a second of a busy host may see no batch finish; the soak as a whole checks many
        assert sum(row["checked"] for row in series if row["rank"] == rank) > int(SOAK)
    assert len(report["tables"]["burn_bars"]) == 2 and report["promise"]["tier"] == "burn"
    assert "# burn 5/5 s, rank 0: second 5 of 5" in proc.stdout
    assert not any(c["name"].startswith(("collectives::", "ddp_resnet::")) for c in report["checks"])


def test_faults_after_seconds_of_load_name_the_rank_and_the_second(tmp_path):
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "injected_burn.py").write_text(
        "from burn_faults import install, pytest_runtest_setup  # noqa: F401\n"
        "install(['sag-after'], rank=0, after_s=3)\n"
        "install(['gemm-wrong-after'], rank=1, after_s=3)\n")
    path = [str(tmp_path / "plugin"), str(PLUGINS), str(REPO), *sys.path]
    proc, report = validate(tmp_path, "--nproc", "2", "--tier", "burn", "--burn-seconds", "7", "--burn-sag", "0.8",
                            env_extra={"PYTHONPATH": ":".join(p for p in path if p), "PYTEST_PLUGINS": "injected_burn"})
    assert proc.returncode == EXIT_FAILED, proc.stdout[-4000:] + proc.stderr[-4000:]
    failed = checks(report, "failed")
    wrong = failed["burn::gemms_give_known_answers_throughout"]
    assert wrong["failed_ranks"] == [1], wrong
    found = {f["check"]: f for f in wrong["findings"]}
    # Right for 3 s from the soak's first product, then wrong.
    for dtype in ("bfloat16", "float16"):
        words = found[f"burn-in known-answer GEMM ({dtype})"]["found"]
        assert re.search(r"rows wrong \(first row 1\) at second [345] of 7", words), words
        assert found[f"burn-in known-answer GEMM ({dtype})"]["rank"] == 1
    sag = [f for f in failed["burn::throughput_holds_over_time"]["findings"] if f["check"] == "burn-in throughput sag"]
    assert [f["rank"] for f in sag] == [0], sag
    assert re.search(r"below from second [3-7] of 7", sag[0]["found"]), sag[0]["found"]
    # Memory and copies held on both ranks: no wrong word. The sagging rank 0 verifies a chunk only once it has
    # passed over the whole buffer, which a loaded host's slowed batches may not reach: then that is what it says.
    memory = {**checks(report, "passed"), **failed}["burn::memory_and_copies_hold_their_data"]
    if memory["outcome"] == "failed":  # then its one finding is that sentence, on rank 0: no wrong word
        assert memory["failed_ranks"] == [0] and "before any memory chunk was verified" in memory["message"], memory
        assert [(f["rank"], "before any memory chunk was verified" in f["found"], f["category"], f["severity"])
                for f in memory["findings"]] == [(0, True, "configuration", "triage")], memory  # alerted, not drained
    else:
        assert not memory.get("findings"), memory
