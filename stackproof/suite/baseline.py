"""Baselines: the median of each figure over a user's own known-good runs, per machine kind, and the rule that a
later run's figure may not be more than a tolerance worse than it (SuperBench's variance rule). docs/baseline.md.

A figure is compared when it is a number whose unit says which way is better (UNIT_BETTER); everything else
(digests, versions, counts, sizes, the transport's name) is left out: those are the other checks' to judge.
"""

from __future__ import annotations

import datetime
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stackproof import __version__
from stackproof.errors import ConfigError
from stackproof.suite import report as report_module
from stackproof.suite.report import REPORT_FILE

SCHEMA = "stackproof.baseline/1"
# Which way is better, by unit: the one place that says it.
UNIT_BETTER = {**dict.fromkeys(("GB/s", "TB/s", "MB/s", "TFLOP/s", "GFLOP/s", "img/s"), "higher"),
               **dict.fromkeys(("us", "ms", "s"), "lower")}
KEY_FIELDS = ("gpu", "ranks_per_node", "nodes", "link")


def is_bar(name: str) -> bool:
    """A pass bar the run derived (from NVML or a flag), or the job's median it holds each GPU or rank to: not a
    measurement of one machine (the GPUs' own figures are compared; a median would blame every rank for one)."""
    return name in ("threshold", "median") or name.endswith("_bar") or name.startswith("median_")


def comparable(name: str, figure: dict[str, Any]) -> bool:
    value = figure.get("value")
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and figure.get("unit") in UNIT_BETTER
            and not is_bar(name))


def per_rank_figures(report: dict[str, Any]) -> dict[int, dict[str, dict[str, dict[str, Any]]]]:
    """rank -> check -> figure -> {"value", "unit"}: each rank's own comparable figures. A rank whose figures
    equal rank 0's has none of its own in report.json (rank_figures), so it gets rank 0's. Per-GPU figures that
    rank 0 records for every GPU (`hbm@host:gpu`) become the figure `hbm` of the rank on that host and GPU."""
    ranks = report.get("ranks") or [{"rank": r} for r in range(int(report.get("world", {}).get("size", 1)))]
    out: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for ident in ranks:
        rank = int(ident["rank"])
        gpu = ident.get("gpu") or {}
        own = f"{ident.get('host', '')}:{gpu.get('index', '')}"
        mine: dict[str, dict[str, dict[str, Any]]] = {}
        for check in report.get("checks", []):
            figures = check.get("figures", {})
            if rank:
                figures = check.get("rank_figures", {}).get(str(rank), figures)
            kept = {}
            for name, figure in figures.items():
                base, at, where = name.partition("@")
                if at and ":" in where:  # a per-GPU figure: only the one of this rank's GPU is this rank's
                    if where != own:
                        continue
                    name = base
                if comparable(name, figure):
                    kept[name] = figure
            if kept:
                mine[check["name"]] = kept
        out[rank] = mine
    return out


def _link(context: dict[str, Any]) -> str:
    """NVLink or PCIe when the report says so (the NCCL transport check, or the derived busbw bar), else ''."""
    transport = context.get("nccl_transport") or {}
    if transport.get("nvlink_up"):
        return "NVLink"
    source = str((context.get("busbw_threshold") or {}).get("source", ""))
    return next((link for link in ("NVLink", "PCIe") if f"({link} " in source), "")


def key_of(report: dict[str, Any]) -> dict[str, Any]:
    """What makes figures comparable: GPU model ("cpu" on CPU runs), ranks (GPUs) per node, nodes, link."""
    models = sorted({(r.get("gpu") or {}).get("name") or "cpu" for r in report.get("ranks", [])}) or ["cpu"]
    world = report.get("world", {})
    return {"gpu": "+".join(models), "ranks_per_node": world.get("local_world_size"), "nodes": world.get("nodes"),
            "link": _link(report.get("context", {}))}


def key_text(key: dict[str, Any]) -> str:
    link = f", {key['link']}" if key.get("link") else ""
    return f"{key['gpu']}, {key['ranks_per_node']} rank(s)/node, {key['nodes']} node(s){link}"


def matches(entry_key: dict[str, Any], key: dict[str, Any]) -> bool:
    """Equal on every field; the link only where both know it (a run without the NCCL transport check)."""
    return all(entry_key.get(f) == key.get(f) for f in KEY_FIELDS if f != "link") and (
        not entry_key.get("link") or not key.get("link") or entry_key["link"] == key["link"])


def read_report(path: Path) -> dict[str, Any]:
    """A known-good report.json (or the reports folder holding one); anything else is refused, exit 2."""
    report = report_module.read_report(path)
    path = path / REPORT_FILE if path.is_dir() else path
    if report.get("verdict") != "OK" or report.get("exit_code") != 0 or not report.get("complete"):
        raise ConfigError(f"{path}: field 'verdict': expected OK (a complete run where every check passed), found "
                          f"{report.get('verdict')!r} (exit code {report.get('exit_code')}: {report.get('message')}); "
                          "a baseline made from failing runs would hold later runs to a broken machine's figures; "
                          "fix: leave this report out")
    return report


def make(paths: Sequence[Path]) -> tuple[dict[str, Any], list[str]]:
    """(the baseline, one line per report naming the key it went to). One entry per key."""
    entries: list[dict[str, Any]] = []
    said = []
    for path in paths:
        report = read_report(path)
        key = key_of(report)
        entry = next((e for e in entries if e["key"] == key), None)
        if entry is None:
            entries.append(entry := {"key": key, "reports": [], "samples": {}})
        entry["reports"].append(str(path))
        said.append(f"# {path}: {key_text(key)}")
        for checks in per_rank_figures(report).values():
            for check, figures in checks.items():
                for name, figure in figures.items():
                    sample = entry["samples"].setdefault(check, {}).setdefault(name, {"unit": figure["unit"],
                                                                                      "values": []})
                    if sample["unit"] != figure["unit"]:
                        raise ConfigError(f"{path}: field 'checks' {check} figure {name}: expected the unit "
                                          f"{sample['unit']!r} of the reports before it, found {figure['unit']!r}; "
                                          "fix: make the baseline from reports of one stackproof version")
                    sample["values"].append(figure["value"])
    for entry in entries:
        samples = entry.pop("samples")
        entry["figures"] = {check: {name: {"median": statistics.median(s["values"]), "unit": s["unit"],
                                           "better": UNIT_BETTER[s["unit"]], "samples": len(s["values"])}
                                    for name, s in sorted(figures.items())}
                            for check, figures in samples.items()}
    baseline = {"schema": SCHEMA, "stackproof": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "entries": entries}
    return baseline, said


def load(path: str | Path) -> dict[str, Any]:
    """A baseline file, checked field by field: exit 2 naming the file and the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--baseline {path}: expected a baseline JSON made by `stackproof baseline`, found "
                          f"{type(err).__name__}: {err}") from None

    def bad(field: str, expected: str, found: Any) -> ConfigError:
        return ConfigError(f"--baseline {path}: field {field}: expected {expected}, found {found!r}; fix: make it "
                           "again with `stackproof baseline REPORT... -o FILE`")

    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise bad("'schema'", repr(SCHEMA), data.get("schema") if isinstance(data, dict) else data)
    if not isinstance(data.get("entries"), list) or not data["entries"]:
        raise bad("'entries'", "a non-empty list", data.get("entries"))
    for i, entry in enumerate(data["entries"]):
        key = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key, dict) or any(f not in key for f in KEY_FIELDS):
            raise bad(f"'entries[{i}].key'", f"an object with {', '.join(KEY_FIELDS)}", key)
        if not isinstance(entry.get("figures"), dict):
            raise bad(f"'entries[{i}].figures'", "an object", entry.get("figures"))
        for check, figures in entry["figures"].items():
            for name, figure in (figures or {}).items():
                where = f"'entries[{i}].figures[{check}][{name}]'"
                median = figure.get("median") if isinstance(figure, dict) else None
                if not isinstance(median, (int, float)) or isinstance(median, bool):
                    raise bad(where + ".median", "a number", median)
                if figure.get("unit") not in UNIT_BETTER:
                    raise bad(where + ".unit", f"one of {', '.join(UNIT_BETTER)}", figure.get("unit"))
    return data


def problem(path: str | None) -> str | None:
    """For the settings' check: the file's first problem, or None."""
    if path is None:
        return None
    try:
        load(path)
    except ConfigError as err:
        return str(err).removeprefix("--baseline ")
    return None


def entry_for(baseline: dict[str, Any], key: dict[str, Any]) -> dict[str, Any] | None:
    return next((e for e in baseline["entries"] if matches(e["key"], key)), None)


def worse(found: float, median: float, better: str, tolerance: float) -> bool:
    """More than `tolerance` (a fraction of the baseline) on the wrong side of it."""
    if better == "higher":
        return found < median * (1 - tolerance)
    return found > median * (1 + tolerance)


def regressions(report: dict[str, Any], entry: dict[str, Any], tolerance: float
                ) -> tuple[int, dict[int, list[str]]]:
    """(figure values compared, rank -> what regressed). Figures of the baseline this run did not measure (a -k
    subset, a tier) are not compared."""
    compared, found_worse = 0, {}
    for rank, checks in per_rank_figures(report).items():
        for check, figures in checks.items():
            for name, figure in figures.items():
                base = entry["figures"].get(check, {}).get(name)
                if base is None or base["unit"] != figure["unit"]:
                    continue
                compared += 1
                better = UNIT_BETTER[base["unit"]]
                if worse(figure["value"], base["median"], better, tolerance):
                    found_worse.setdefault(rank, []).append(
                        f"{check} {name}: found {figure['value']:g} {figure['unit']}, baseline {base['median']:g} "
                        f"{base['unit']} (median of {base.get('samples', '?')}; {better} is better), tolerance "
                        f"{tolerance:.0%}")
    return compared, found_worse


def keys_text(entries: Iterable[dict[str, Any]]) -> str:
    return "; ".join(key_text(e["key"]) for e in entries)
