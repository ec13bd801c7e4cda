"""Localization run for real on CPU ranks of this host (gloo): a slow link between two local ranks is named as
that pair, not as a rank; the local pair matrix is part of the fast tier."""

import json
import os
import re
import subprocess
import sys

RUN_TIMEOUT_S = 300
# CPU ranks on a shared host: a wide tolerance (the fault is 10x; noise reaches 2x).
TOLERANT = ["--pair-tolerance", "0.75", "--timeout", "60"]


def validate(tmp_path, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NVIDIA_VISIBLE_DEVICES", "STACKPROOF_REPORTS", "PYTEST_ADDOPTS")}
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports), *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**env, "OMP_NUM_THREADS": "1"})
    return proc, json.loads((reports / "report.json").read_text())


def test_slow_link_between_two_local_ranks_names_that_pair(tmp_path):
    proc, report = validate(tmp_path, "--nproc", "3", "-k", "local_pairs", "--inject-fault", "slow-link",
                            "--fault-rank", "1", *TOLERANT)
    assert proc.returncode == 1, proc.stdout[-4000:]
    (check,) = report["checks"]
    assert check["name"] == "pairwise::local_pairs" and check["failed_ranks"] == [1, 2], check
    assert re.search(r": rank 1 <-> rank 2 \(CPU ranks, gloo\): [0-9.]+ GB/s, [0-9.]+ GB/s again; bar [0-9.]+ GB/s "
                     r"\(slow pair\)",
                     check["message"]), check["message"]
    assert "every pair slow" not in check["message"]
    rows = {(r["a"], r["b"]): r for r in report["tables"]["pairwise_local"]}
    assert [pair for pair, r in rows.items() if r["slow"]] == [(1, 2)]
    assert rows[(1, 2)]["gbps"] < rows[(0, 1)]["gbps"] / 4
    # The matrix on stdout: three data rows, the slow cell in row 1, column 2.
    matrix = [line.split() for line in proc.stdout.splitlines() if re.match(r"^ +rank \d ", line)]
    assert len(matrix) == 3 and matrix[1][3] == "-", matrix
    assert abs(float(matrix[1][4]) - rows[(1, 2)]["gbps"]) < 0.01, matrix


def test_local_pairs_are_in_the_fast_tier_and_two_ranks_are_measured_not_judged(tmp_path):
    """Two CPU ranks make one pair, its own reference: no bar, so no PASS (SKIP, saying why); the fast tier on
    a CPU host promises the host check only, so the run is still OK (judge/promise.py)."""
    proc, report = validate(tmp_path, "--nproc", "2", "--tier", "fast", *TOLERANT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = {c["name"]: c for c in report["checks"]}
    pairs = checks["pairwise::local_pairs"]
    assert pairs["outcome"] == "skipped" and "no bar" in pairs["message"], pairs
    assert "--min-pair-gbps" in pairs["message"] and pairs["figures"]["pairs"]["value"] == 1
    assert checks["host::dev_shm_is_large_enough"]["outcome"] == "passed"
    assert "pairwise::node_pairs" not in checks and not any(n.startswith("stragglers::") for n in checks)
    assert report["tables"]["pairwise_local"][0]["gbps"] > 0


def test_a_rank_that_never_answers_its_pair_is_named_not_waited_for(tmp_path):
    proc, report = validate(tmp_path, "--nproc", "3", "-k", "local_pairs", "--inject-fault", "hang",
                            "--fault-rank", "1", "--timeout", "10",
                            "--check-timeout", "4")  # the watchdog answers first: a rank stuck in its own code
    assert proc.returncode == 4, proc.stdout[-4000:]
    assert "rank(s) [1] stalled outside any collective (rank 1 at faults.py:" in report["message"], report["message"]
    assert report["checks"][0]["name"] == "pairwise::local_pairs" and report["checks"][0]["failed_ranks"] == [1]
    # A CPU rank stalled in its own code is a tool timeout, never a GPU hang (judge/hang.py, issue 25).
    assert [(f["check"], f["category"], f["rank"]) for f in report["checks"][0]["findings"]] == [
        ("check timed out", "tool-error", 1)]
