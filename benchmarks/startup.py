"""Where a validation run's wall time goes: start, imports, CUDA init, process-group init, checks, teardown.

    python benchmarks/startup.py                              # validate --tier fast, 3 runs
    python benchmarks/startup.py --runs 2 -- healthcheck --scheduler none
    python benchmarks/startup.py -- validate                  # the full tier

Runs `python -m stackproof ARGS --reports TMP` and prints one row per phase, in seconds since the command
started: what the terminal showed (the header line, the verdict line, the exit) and what the run recorded in
report.json's context["phases"] (epoch times: the launcher's start and its ranks' start, each rank's torch import,
CUDA init, process group, then the checks and the report; the slowest rank's time for per-rank phases), plus the
sum of the checks' own durations. Figures, not a test: the targets (issue 19: fast tier <= 10 s on one warm GPU,
<= 15 s on 8) are read here, never asserted in CI.

Measured on 1 x H200 (warm, torch 2.11, medians of 3): validate --tier fast 7.5 s (23.3 s with torchrun's agent and
the launcher importing torch), healthcheck --scheduler none 7.8 s (24.6 s); the ranks' import of torch is 3.4-4.4 s
of it, the checks 1.3 s. The full tier: 28 s warm (47 s before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stackproof.run.phases import RANK_PHASES, RUN_PHASES  # noqa: E402 (after the checkout is on the path)

# The rows, in the order a run passes them: what the terminal showed, and what report.json recorded.
ORDER = ("launcher_started", "header", *RANK_PHASES, "checks_started", "first_table_line", "checks_done",
         "ranks_exited", "verdict", "exit")


def one_run(args: list[str], timeout_s: float) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="stackproof-startup-") as reports:
        command = [sys.executable, "-m", "stackproof", *args, "--reports", reports]
        seen: dict[str, float | None] = {"header": None, "first_table_line": None, "verdict": None}
        begin = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time() - begin
            if line.startswith("# stackproof validate:") and seen["header"] is None:
                seen["header"] = now
            elif seen["header"] is not None and seen["first_table_line"] is None and line.strip():
                seen["first_table_line"] = now
            if line.startswith("# Verdict:"):
                seen["verdict"] = now
        rc = proc.wait(timeout=timeout_s)
        seen["exit"] = time.time() - begin
        try:
            report = json.loads((Path(reports) / "report.json").read_text())
        except (OSError, ValueError):
            report = {}
    phases = report.get("context", {}).get("phases", {})
    for name in ("launcher_started", *RUN_PHASES):
        seen[name] = phases[name] - begin if phases.get(name) else None
    for name in RANK_PHASES:  # the slowest rank's
        times = [r[name] for r in phases.get("ranks") or [] if r.get(name)]
        seen[name] = max(times) - begin if times else None
    row = {name: seen.get(name) for name in ORDER}
    row["exit code"] = rc
    row["checks (sum of their own seconds)"] = sum(c.get("duration_s", 0.0) for c in report.get("checks", []))
    for check in report.get("checks", []):
        row[f"  {check['name']}"] = check.get("duration_s")
    return row


def table(runs: list[dict[str, float | None]]) -> str:
    names: list[str] = []
    for run in runs:
        names += [n for n in run if n not in names]
    lines = [f"# {'phase':<48} " + " ".join(f"{'run ' + str(i + 1):>8}" for i in range(len(runs))) + f" {'median':>8}",
             f"# {'(s since the command started; checks: own seconds)':<48}"]
    for name in names:
        values = [run.get(name) for run in runs]
        known = [v for v in values if v is not None]
        cells = " ".join(f"{v:>8.2f}" if v is not None else f"{'-':>8}" for v in values)
        median = f"{statistics.median(known):>8.2f}" if known else f"{'-':>8}"
        lines.append(f"  {name:<48} {cells} {median}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("args", nargs="*", help="stackproof's command and flags (default: validate --tier fast)")
    options = parser.parse_args(argv)
    args = options.args or ["validate", "--tier", "fast"]
    runs = [one_run(args, options.timeout) for _ in range(options.runs)]
    print(f"# python -m stackproof {' '.join(args)}: {options.runs} run(s)")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
