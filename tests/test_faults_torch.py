"""Faults in torch / torch.distributed, injected from outside the suite (tests/fault_plugins/torch_faults.py,
loaded on the ranks as a pytest plugin), turn real CPU runs red in the check that should catch them, while the
checks each fault leaves alone stay green. Rank-vs-rank comparison misses all of these: every rank agrees."""

import sys
from pathlib import Path

from test_validate_cpu import EXIT_FAILED, checks, validate

PLUGINS = Path(__file__).parent / "fault_plugins"
REPO = Path(__file__).parent.parent


def validate_with_faults(tmp_path, faults, *args, rank=1):
    """A run whose ranks load a plugin that installs `faults` before the suite's checks run."""
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "injected_faults.py").write_text(
        f"import torch_faults\ntorch_faults.install({list(faults)!r}, rank={rank})\n")
    path = [str(tmp_path / "plugin"), str(PLUGINS), str(REPO), *sys.path]
    return validate(tmp_path, "--nproc", "2", *args,
                    env_extra={"PYTHONPATH": ":".join(p for p in path if p), "PYTEST_PLUGINS": "injected_faults"})


def failed_messages(report):
    return {name: check["message"] for name, check in checks(report, "failed").items()}


def test_collective_faults_every_rank_agrees_on_are_caught(tmp_path):
    proc, report = validate_with_faults(
        tmp_path, ["sum-truncates", "mid-range-corrupts", "reduce-scatter-avg-sums", "all-gather-stale"],
        "--max-check-bytes", "64K", "-k", "all_reduce and sum or reduce_scatter and avg or all_gather")
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = failed_messages(report)
    # round toward zero: the rounding elements (2**8 + 1.5 -> 258 to nearest, 256 truncated)
    assert "index 15" in failed["collectives::all_reduce[sum-bfloat16]"]
    assert "expected 258.0" in failed["collectives::all_reduce[sum-bfloat16]"]
    assert "expected 2050.0" in failed["collectives::all_reduce[sum-float16]"]
    # one element of a 64 KiB message (a 4 KiB multiple): every dtype's 64 KiB case
    assert "(65536 B)" in failed["collectives::all_reduce[sum-float32]"]
    assert "(65536 B)" in failed["collectives::all_reduce[sum-int64]"]
    for dtype in ("float32", "float16", "bfloat16", "float64"):  # AVG returned as the sum: 2x the mean
        assert f"collectives::reduce_scatter[avg-{dtype}]" in failed
    for dtype in ("float32", "bfloat16", "int64"):  # the second call on a shape got the first call's data
        assert "call 1" in failed[f"collectives::all_gather[{dtype}]"]
    assert "rank(s) [0, 1]" in failed["collectives::all_gather[int64]"]
    assert set(failed) == {*(f"collectives::all_reduce[sum-{d}]" for d in
                             ("float32", "float16", "bfloat16", "float64", "int32", "int64")),
                           *(f"collectives::reduce_scatter[avg-{d}]" for d in ("float32", "float16", "bfloat16",
                                                                                "float64")),
                           *(f"collectives::all_gather[{d}]" for d in ("float32", "bfloat16", "int64"))}
