"""Baseline files: made from a user's own known-good runs (the median, spread and tolerance of each figure, per
machine kind), and read back, checked field by field. What is compared, and how, is judged in
stackproof/judge/baseline.py. docs/baseline.md.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stackproof import __version__, files
from stackproof.errors import ConfigError
from stackproof.judge import promise
from stackproof.judge.baseline import (
    KEY_FIELDS,
    UNIT_BETTER,
    entry_for,
    key_of,
    key_text,
    keys_text,
    per_rank_figures,
    summary,
)
from stackproof.report import record as report_module

# The judgement's names that callers of the files use (stackproof baseline, the HTML page).
__all__ = ["SCHEMA", "UNIT_BETTER", "entry_for", "key_of", "key_text", "keys_text", "load", "make", "per_rank_figures",
           "problem", "read_report"]

SCHEMA = "stackproof.baseline/1"


def read_report(path: Path) -> dict[str, Any]:
    """A known-good report.json (or the reports folder holding one); anything else is refused, exit 2."""
    report = report_module.read_report(path)
    promise.require_known_good(str(report_module.report_file(path)), report, "baseline")
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
        for checks in per_rank_figures(report, own_only=True).values():
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
        if not samples:  # a baseline of nothing would pass every later run
            raise ConfigError(f"{', '.join(entry['reports'])}: field 'checks': expected figures a baseline holds "
                              f"(a GPU's or rank's own {', '.join(UNIT_BETTER)}), found none for "
                              f"{key_text(entry['key'])}; fix: make the baseline from runs that measure (on GPUs "
                              "any tier does; on CPU ranks --tier full, or -k busbw), docs/baseline.md")
        entry["figures"] = {check: {name: summary(s["values"], s["unit"]) for name, s in sorted(figures.items())}
                            for check, figures in samples.items()}
    baseline = {"schema": SCHEMA, "stackproof": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "entries": entries}
    return baseline, said


def load(path: str | Path) -> dict[str, Any]:
    """A baseline file, checked field by field: exit 2 naming the file and the field."""
    path = Path(path)
    data = files.read_json(path, "a baseline JSON made by `stackproof baseline`", "name the file `stackproof "
                           "baseline REPORT... -o FILE` wrote (make one from known-good runs: docs/baseline.md)",
                           flag="--baseline", finite=True)

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
        if not isinstance(entry.get("figures"), dict) or not any(entry["figures"].values()):
            raise bad(f"'entries[{i}].figures'", "an object with at least one figure", entry.get("figures"))
        for check, figures in entry["figures"].items():
            for name, figure in (figures or {}).items():
                where = f"'entries[{i}].figures[{check}][{name}]'"
                median = figure.get("median") if isinstance(figure, dict) else None
                if not isinstance(median, (int, float)) or isinstance(median, bool):
                    raise bad(where + ".median", "a number", median)
                if figure.get("unit") not in UNIT_BETTER:
                    raise bad(where + ".unit", f"one of {', '.join(UNIT_BETTER)}", figure.get("unit"))
                tolerance = figure.get("tolerance")
                if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                              or not 0 < tolerance < 1):
                    raise bad(where + ".tolerance", "a fraction in (0, 1)", tolerance)
    return data


problem = files.load_problem(load, "--baseline")  # for the settings' check


