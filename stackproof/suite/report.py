"""The verdict as a contract: a JSON report, and the same facts as a table where every non-data line starts
with '#' and the last line says OK or FAILED (as nccl-tests does). The exit code comes from the same records."""

from __future__ import annotations

import dataclasses
import json
import platform
import socket
import time
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3
EXIT_INCOMPLETE = 4
EXIT_CODES = {
    EXIT_OK: "every check ran and passed",
    EXIT_FAILED: "a check failed",
    EXIT_USAGE: "bad flags or settings: nothing ran",
    EXIT_NO_GPU: "no GPU visible, but GPUs were expected",
    EXIT_INCOMPLETE: "the run did not complete: a rank died or timed out",
}


@dataclasses.dataclass
class Figure:
    value: float | int | str
    unit: str = ""

    def text(self) -> str:
        value = f"{self.value:.4g}" if isinstance(self.value, float) else str(self.value)
        return f"{value} {self.unit}".strip()


@dataclasses.dataclass
class Check:
    nodeid: str
    outcome: str = "passed"  # passed | failed | skipped
    duration_s: float = 0.0
    message: str = ""
    hint: str = ""
    figures: dict[str, Figure] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        # smoke_tests/test_04_collectives.py::test_all_reduce[sum-float32] -> collectives::all_reduce[sum-float32]
        module, _, test = self.nodeid.rpartition("::")
        module = Path(module).stem.removeprefix("test_").lstrip("0123456789_")
        return f"{module}::{test.removeprefix('test_')}"

    @property
    def verdict(self) -> str:
        return {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[self.outcome]


@dataclasses.dataclass
class Report:
    context: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.time)
    verdict_override: tuple[int, str] | None = None

    def check(self, nodeid: str) -> Check:
        for existing in self.checks:
            if existing.nodeid == nodeid:
                return existing
        self.checks.append(Check(nodeid))
        return self.checks[-1]

    def counts(self) -> dict[str, int]:
        return {o: sum(c.outcome == o for c in self.checks) for o in ("passed", "failed", "skipped")}

    @property
    def exit_code(self) -> int:
        if self.verdict_override:
            return self.verdict_override[0]
        if not self.checks:
            return EXIT_INCOMPLETE
        return EXIT_FAILED if self.counts()["failed"] else EXIT_OK

    @property
    def verdict(self) -> str:
        return "OK" if self.exit_code == EXIT_OK else "FAILED"

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "exit_meaning": self.verdict_override[1] if self.verdict_override else EXIT_CODES[self.exit_code],
            "wall_time_s": round(time.time() - self.started, 3),
            "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                     "python": platform.python_version()},
            "context": self.context,
            "counts": self.counts(),
            "checks": [{**dataclasses.asdict(c), "name": c.name, "verdict": c.verdict} for c in self.checks],
            "tables": self.tables,
        }

    def write(self, reports_dir: Path) -> Path:
        reports_dir.mkdir(parents=True, exist_ok=True)
        path = reports_dir / "report.json"
        path.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")
        return path

    def table(self) -> str:
        rows = [(c.name, c.verdict, "; ".join(f"{k}={f.text()}" for k, f in c.figures.items()), _note(c))
                for c in self.checks]
        width = max([len("check"), *(len(r[0]) for r in rows)])
        fig_width = min(60, max([len("figure"), *(len(r[2]) for r in rows)]))
        lines = [f"# {'check':<{width}}  verdict  {'figure':<{fig_width}}  hint"]
        lines += [f"  {name:<{width}}  {verdict:<7}  {figure:<{fig_width}}  {hint[:240]}".rstrip()
                  for name, verdict, figure, hint in rows]
        counts = self.counts()
        lines.append("#")
        lines.append(f"# Out of {len(self.checks)} checks: {counts['passed']} passed, {counts['failed']} failed, "
                     f"{counts['skipped']} skipped; wall time {time.time() - self.started:.1f} s")
        if self.verdict_override:
            lines.append(f"# {self.verdict_override[1]}")
        lines.append(f"# Verdict: {self.verdict} (exit code {self.exit_code}: {EXIT_CODES[self.exit_code]})")
        return "\n".join(lines)


def _note(check: Check) -> str:
    """The table's last column: why it failed and the fix, or why it was skipped."""
    if check.outcome == "passed":
        return ""
    first_line = check.message.splitlines()[0] if check.message else ""
    if check.outcome == "failed" and check.hint:
        return f"{first_line} -- fix: {check.hint}"
    return first_line
