"""The verdict as a contract (docs/report-format.md): the run's typed record (its schema, its reader, report.json's
fields, its exit code, its nodes). Its renderings only read it: report.json, junit.xml and stackproof.prom are
written by report/outputs.py, the terminal table by report/terminal.py, the page by report/page.py.

report.json is written as soon as rank 0 knows the world (verdict INCOMPLETE, "running"), and replaced by the
final verdict only when rank 0 finishes: a run killed at any point never leaves a passing report behind.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stackproof import __version__
from stackproof.errors import ConfigError, Exit, StackproofError
from stackproof.judge import promise
from stackproof.judge.findings import Finding
from stackproof.report import folders

# The record's shape (docs/report-format.md). 2: findings per rank (Check.findings, Report.findings), where 1 had
# one category and severity per check.
SCHEMA = "stackproof.report/2"
REPORT_FILE, JUNIT_FILE, PROMETHEUS_FILE = "report.json", "junit.xml", "stackproof.prom"
UNREADABLE_FILE = "report.unreadable.json"  # a report.json that could not be read, kept as evidence


class ReportUnreadable(StackproofError):
    """report.json is there but cannot be read as a report: the caller keeps it (evidence) and says why."""

    exit_code = Exit.INCOMPLETE


class ReportUnwritable(StackproofError):
    """The reports folder would not take the report (full disk, quota, read-only): a tool error, not a check's
    failure. Exit 4: the run did not complete, since its verdict could not be recorded; nothing is acted on."""

    exit_code = Exit.INCOMPLETE


# The fields every reader relies on, and their JSON types: a report.json of another shape is refused at the door.
SHAPE: dict[str, type | tuple[type, ...]] = {"exit_code": int, "settings": dict, "ranks": list, "nodes": list,
                                             "checks": list, "findings": list}


def report_file(path: Path) -> Path:
    """The report.json a path names: the file itself, or the one of a reports folder (its newest run when the
    folder keeps its runs: healthcheck's, report/folders.py)."""
    return folders.current(path) / REPORT_FILE if path.is_dir() else path


def read_report(path: Path) -> dict[str, Any]:
    """A finished run's report.json (or the reports folder holding one), of this schema and shape; anything else:
    exit 2 with the fix. The one door every reader of report.json goes through (act, spec, baseline, report)."""
    path = report_file(path)
    fix = "fix: give report.json files written by `stackproof validate` of this stackproof (re-run it)"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: expected a finished run's report.json, found no such file; fix: point at the "
                          "folder `stackproof validate --reports DIR` wrote, or its report.json") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: expected a stackproof report.json, found {getattr(err, 'strerror', None) or err}"
                          f"; {fix}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else f"a JSON {_JSON_NAMES.get(type(data), 'value')}"
        raise ConfigError(f"{path}: field 'schema': expected {SCHEMA!r}, found {found!r}; {fix}")
    for name, kind in SHAPE.items():
        if not isinstance(data.get(name), kind):
            raise ConfigError(f"{path}: field {name!r}: expected a JSON {_json_kind(kind)}, found "
                              f"{type(data.get(name)).__name__} {str(data.get(name))[:40]!r}; {fix}")
    for field in ("nodes", "ranks"):
        for entry in data[field]:
            if not isinstance(entry, dict) or not isinstance(entry.get("node"), str) or not entry["node"]:
                raise ConfigError(f"{path}: field {field!r}: expected entries each with a node name, found "
                                  f"{str(entry)[:60]!r}; {fix}")
    # Rows the readers index by name (spec's per_gpu_facts, report's nodes[].gpus): objects, else a traceback.
    rows = {f"tables.{name}": table for name, table in (data.get("tables") or {}).items()} \
        if isinstance(data.get("tables", {}), dict) else {"tables": data["tables"]}
    rows.update({f"nodes[{i}].gpus": node.get("gpus", []) for i, node in enumerate(data["nodes"])})
    for where, table in rows.items():
        odd = table if not isinstance(table, list) else next((r for r in table if not isinstance(r, dict)), None)
        if odd is not None:
            raise ConfigError(f"{path}: field {where!r}: expected a JSON array of objects, found "
                              f"{type(odd).__name__} {str(odd)[:40]!r}; {fix}")
    return data


_JSON_NAMES = {type(None): "null", bool: "true/false", int: "number", float: "number", str: "string",
               list: "array"}


def _json_kind(kind: type | tuple[type, ...]) -> str:
    return {int: "number", dict: "object", list: "array", str: "string"}.get(kind, str(kind))  # type: ignore[call-overload]


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
    failed_ranks: list[int] = dataclasses.field(default_factory=list)
    # Every failing rank's own findings (judge/findings.py), each naming its node, rank and GPU.
    findings: list[Finding] = dataclasses.field(default_factory=list)
    figures: dict[str, Figure] = dataclasses.field(default_factory=dict)
    # Figures of the ranks whose figures differ from rank 0's (per-GPU measurements), by rank.
    rank_figures: dict[int, dict[str, Figure]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        # smoke_tests/test_04_collectives.py::test_all_reduce[sum-float32] -> collectives::all_reduce[sum-float32]
        module, _, test = self.nodeid.rpartition("::")
        module = Path(module).stem.removeprefix("test_").lstrip("0123456789_")
        return f"{module}::{test.removeprefix('test_')}"

    @property
    def verdict(self) -> str:
        return {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[self.outcome]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["figures"] = {k: dataclasses.asdict(f) for k, f in self.figures.items()}
        data["findings"] = [f.to_json() for f in self.findings]
        data["rank_figures"] = {str(r): {k: dataclasses.asdict(f) for k, f in figs.items()}
                                for r, figs in self.rank_figures.items()}
        return {"name": self.name, "verdict": self.verdict, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Check:
        fields = {f.name for f in dataclasses.fields(cls)}
        check = cls(**{k: v for k, v in data.items() if k in fields})
        check.figures = {k: Figure(**f) for k, f in data.get("figures", {}).items()}
        check.findings = [Finding.from_json(f) for f in data.get("findings", [])]
        check.rank_figures = {int(r): {k: Figure(**f) for k, f in figs.items()}
                              for r, figs in data.get("rank_figures", {}).items()}
        return check


@dataclasses.dataclass
class Report:
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    world: dict[str, Any] = dataclasses.field(default_factory=dict)
    ranks: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # identity.RankIdentity, as dicts
    image: dict[str, Any] = dataclasses.field(default_factory=dict)
    context: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)
    tables: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    # nodeids pytest selected: a check among them that never reported makes the run incomplete.
    planned: list[str] = dataclasses.field(default_factory=list)
    # nodeids this run's tier promises on this world, from the checks' declarations (judge/promise.py), before
    # -k narrowed them; and every collected check's declaration, by nodeid.
    promised: list[str] = dataclasses.field(default_factory=list)
    declarations: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.time)
    wall_time_s: float | None = None
    # (exit code, why) when the checks alone do not tell: a dead or hung rank, an interruption, bad input.
    override: tuple[int, str] | None = None
    complete: bool = False  # rank 0 finished and wrote this verdict
    # Findings of the run rather than of one check: the launcher's pre-flight (a GPU lost, GPUs missing), a hang
    # the watchdog pinned, a rank that died.
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def check(self, nodeid: str) -> Check:
        for existing in self.checks:
            if existing.nodeid == nodeid:
                return existing
        self.checks.append(Check(nodeid))
        return self.checks[-1]

    def counts(self) -> dict[str, int]:
        return {o: sum(c.outcome == o for c in self.checks) for o in ("passed", "failed", "skipped")}

    def not_run(self) -> list[str]:
        done = {c.nodeid for c in self.checks}
        return [nodeid for nodeid in self.planned if nodeid not in done]

    def _outcomes(self) -> list[tuple[str, str, str, str]]:
        return [(c.nodeid, c.name, c.outcome, c.message) for c in self.checks]

    def unjudged(self) -> list[str]:
        """The checks this run promised that it did not judge (judge/promise.py)."""
        if not self.complete:
            return []
        return promise.unjudged(self._outcomes(), self.promised)

    def left_out(self) -> list[str]:
        """The promised checks -k left out: said, not held against the run."""
        if not self.complete:
            return []
        return promise.left_out(self.promised, self.planned, lambda nodeid: Check(nodeid).name)

    @property
    def exit_code(self) -> Exit:
        if self.override:
            return Exit(self.override[0])
        if not self.complete or not self.checks or self.not_run():
            return Exit.INCOMPLETE
        # Any finding fails the run: a check's, and one of the run itself (a rank the kernel could not kill after
        # the verdict, a GPU lost at pre-flight).
        if self.counts()["failed"] or self.all_findings():
            return Exit.FAILED
        # No PASS without a judgement: nothing judged, or a promised check not judged, is not a proof.
        if promise.nothing_judged(self._outcomes()) or self.unjudged():
            return Exit.INCOMPLETE
        return Exit.OK

    @property
    def message(self) -> str:
        if self.override:
            return self.override[1]
        if not self.complete:
            return "the run has not finished (rank 0 did not write its verdict: it is running, or was killed)"
        if not self.checks:
            return "no check ran"
        missing = self.not_run()
        if missing:
            return f"{len(missing)} of {len(self.planned)} checks never ran, from {Check(missing[0]).name}"
        found = self.all_findings()
        if self.exit_code == Exit.FAILED and found and not self.counts()["failed"]:
            more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
            return f"every check passed, but the run found: {found[0]}{more}"
        if self.exit_code == Exit.INCOMPLETE:
            nothing = promise.nothing_judged(self._outcomes())
            if nothing:
                return f"no check was judged: {nothing}"
            kind, tier = promise.World.from_record(self.world).kind, self.settings.get("tier", "full")
            return (f"not judged: {'; '.join(self.unjudged())} (tier {tier} on this {kind.upper()} run promises "
                    "these, by their declarations: docs/report-format.md)")
        return self.exit_code.meaning

    # Identity: which node and GPU each rank is.
    def where(self, rank: int) -> str:
        from stackproof.measure.identity import from_json

        if 0 <= rank < len(self.ranks):
            return from_json(self.ranks[rank]).where()
        return f"rank {rank}"

    def all_findings(self) -> list[Finding]:
        """The run's findings and every check's, each with its node ('' where the run names none)."""
        return [*self.findings, *(f for c in self.checks for f in c.findings)]

    def remedies(self) -> list[dict[str, Any]]:
        """Every finding's typed remedy, cheapest step first (judge/policy.py's REMEDIES): derived, never read back."""
        from stackproof.judge import policy

        return [policy.remedy_json(f) for f in self.all_findings()]

    def nodes(self) -> list[dict[str, Any]]:
        """Per node: verdict, failing checks, its ranks and GPUs (the unit a platform team drains), for the
        renderings; what is done to a node is act/decide.py's, from the findings."""
        by_node: dict[str, dict[str, Any]] = {}
        for ident in self.ranks:
            node = by_node.setdefault(ident["node"], {"node": ident["node"], "hosts": [], "ranks": [], "gpus": [],
                                                      "failed_checks": [], "verdict": "PASS"})
            node["ranks"].append(ident["rank"])
            if ident["host"] not in node["hosts"]:
                node["hosts"].append(ident["host"])
            if ident.get("gpu"):
                node["gpus"].append({k: ident["gpu"].get(k) for k in ("index", "uuid", "serial", "pci_bus_id")})
        node_of = {ident["rank"]: ident["node"] for ident in self.ranks}
        for check in self.checks:
            for rank in check.failed_ranks:
                node = by_node.get(node_of.get(rank, ""))
                if node is None:
                    continue
                node["verdict"] = "FAIL"
                entry = next((f for f in node["failed_checks"] if f["check"] == check.name), None)
                if entry is None:
                    node["failed_checks"].append(entry := {"check": check.name, "ranks": []})
                entry["ranks"].append(rank)
        for finding in self.findings:
            node = by_node.get(finding.node) or (next(iter(by_node.values())) if len(by_node) == 1 else None)
            if node is not None:
                node["verdict"] = "FAIL"
                if not any(f["check"] == finding.source for f in node["failed_checks"]):
                    node["failed_checks"].append({"check": finding.source or finding.check, "ranks": []})
        return list(by_node.values())

    def to_json(self) -> dict[str, Any]:
        code = self.exit_code
        return {
            "schema": SCHEMA,
            "stackproof": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "verdict": code.verdict,
            "exit_code": int(code),
            "exit_meaning": code.meaning,
            "message": self.message,
            "complete": self.complete,
            "started": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "wall_time_s": round(self.wall_time_s if self.wall_time_s is not None else time.time() - self.started, 3),
            "settings": self.settings,
            "host": {"platform": platform.platform(), "python": platform.python_version()},
            "image": self.image,
            "world": self.world,
            "ranks": self.ranks,
            "nodes": self.nodes(),
            "counts": {**self.counts(), "planned": len(self.planned), "not_run": len(self.not_run())},
            "checks": [c.to_json() for c in self.checks],
            "not_run": [Check(n).name for n in self.not_run()],
            "promise": {"host": promise.World.from_record(self.world).kind, "tier": self.settings.get("tier"),
                        "not_judged": self.unjudged(), "left_out_by_selection": self.left_out()},
            "planned": self.planned,
            "promised": self.promised,
            "declarations": self.declarations,
            "tables": self.tables,
            "findings": [f.to_json() for f in self.findings],
            "remedies": self.remedies(),
            "context": self.context,
            "override": list(self.override) if self.override else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        report = cls(settings=data.get("settings", {}), world=data.get("world", {}), ranks=data.get("ranks", []),
                     image=data.get("image", {}), context=data.get("context", {}),
                     checks=[Check.from_json(c) for c in data.get("checks", [])], tables=data.get("tables", {}),
                     wall_time_s=data.get("wall_time_s"), complete=data.get("complete", False),
                     findings=[Finding.from_json(f) for f in data.get("findings", [])])
        report.planned = data.get("planned", [])
        report.promised, report.declarations = data.get("promised", []), data.get("declarations", {})
        legacy_unjudged = (data.get("promise") or {}).get("not_judged")
        if "promised" not in data and legacy_unjudged and not data.get("override"):
            # Written before the declarations: its promise is what it said then.
            report.override = (int(Exit.INCOMPLETE), data.get("message") or "; ".join(legacy_unjudged))
        started = data.get("started")
        if started:
            report.started = datetime.datetime.fromisoformat(started).timestamp()
        if data.get("override"):
            report.override = (int(data["override"][0]), data["override"][1])
        return report

    @classmethod
    def read(cls, path: Path) -> Report:
        """A finished run's record, through read_report's door (exit 2 with the fix for anything else)."""
        data = read_report(path)
        try:
            return cls.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{path}: expected a stackproof report.json ({SCHEMA}), found a record that does not "
                              f"load ({err}); fix: re-run `stackproof validate`") from None

    @classmethod
    def load(cls, reports_dir: Path) -> Report | None:
        """The report in the folder; None when there is none; ReportUnreadable (with the real error) when there
        is one that cannot be read."""
        path = reports_dir / REPORT_FILE
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("schema") not in (SCHEMA, None):
                read_report(path)  # another schema: exit 2 with the fix, the same words as every other reader
            return cls.from_json(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ReportUnreadable(f"{path}: expected a stackproof report.json, found {type(err).__name__}: "
                                   f"{err}") from None


def stale_outputs() -> Iterable[str]:
    """The files a run writes at the top of its reports folder: removed before a run, so none can be read as
    this run's."""
    return (REPORT_FILE, JUNIT_FILE, PROMETHEUS_FILE, UNREADABLE_FILE, "exit-code")
