"""The run's output files, each rendered from the record and replaced atomically: report.json (the record
itself), junit.xml (for CI systems) and stackproof.prom (node_exporter's textfile, report/metrics.py). The
record only holds and reads; this module writes (docs/report-format.md)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from stackproof.errors import ConfigError, Exit
from stackproof.report import metrics
from stackproof.report.record import JUNIT_FILE, PROMETHEUS_FILE, REPORT_FILE, Report, ReportUnwritable
from stackproof.report.terminal import first_line


def write(report: Report, reports_dir: Path) -> Path:
    """report.json, junit.xml and the Prometheus textfile, each replaced atomically."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    _replace(reports_dir / REPORT_FILE, json.dumps(report.to_json(), indent=2, default=str) + "\n")
    _replace(reports_dir / JUNIT_FILE, junit(report))
    _replace(reports_dir / PROMETHEUS_FILE, metrics.textfile(report))
    return reports_dir / REPORT_FILE


# The same records as JUnit XML, for CI systems.
def junit(report: Report) -> str:
    counts = report.counts()
    incomplete = report.exit_code not in (Exit.OK, Exit.FAILED)
    suite = ET.Element("testsuite", name="stackproof", tests=str(len(report.checks) + incomplete),
                       failures=str(counts["failed"]), errors=str(int(incomplete)),
                       skipped=str(counts["skipped"]), time=f"{time.time() - report.started:.3f}")
    for check in report.checks:
        module, _, test = check.name.partition("::")
        case = ET.SubElement(suite, "testcase", classname=module, name=test, time=f"{check.duration_s:.3f}")
        if check.outcome == "failed":
            ET.SubElement(case, "failure", message=first_line(check.message)).text = \
                check.message + (f"\nfix: {check.hint}" if check.hint else "")
        elif check.outcome == "skipped":
            ET.SubElement(case, "skipped", message=first_line(check.message))
    if incomplete:
        case = ET.SubElement(suite, "testcase", classname="stackproof", name="run")
        ET.SubElement(case, "error", message=report.exit_code.meaning).text = report.message
    return ET.tostring(_wrap(suite), encoding="unicode") + "\n"


def _wrap(suite: ET.Element) -> ET.Element:
    root = ET.Element("testsuites")
    root.append(suite)
    return root


def _replace(path: Path, text: str) -> None:
    """Write a temporary file next to `path` and move it over it: readers see the old file or the new one. A
    failed write leaves no temporary file, and says so in one line (ReportUnwritable)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.chmod(tmp, 0o664)  # a later run in a container (another uid) must be able to replace it
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ReportUnwritable(f"{path}: could not write the run's report ({err.strerror or err}); the checks' "
                               "outcome is not recorded; fix: free space in the reports folder (or make it "
                               "writable), or pass --reports DIR on a disk with room, and run again") from None


def output_file(path: Path, what: str, example: str, inputs: Iterable[Path] = (), flag: str = "-o",
                remakes: Callable[[Path], bool] = lambda _path: False) -> Path:
    """Where a command may write its one output file, checked before any work: a file (new, or one this command
    made before: `remakes`) in a folder that exists, none of the files it reads, and no evidence: no run's
    record, no file of a run's folder (junit.xml, stackproof.prom, attestation.json, rank logs), no other
    stackproof file (a baseline, a spec). Anything else: exit 2, nothing written, no folder made."""
    path = Path(path)

    def refuse(found: str, fix: str = f"name another file, e.g. {flag} {example}") -> ConfigError:
        return ConfigError(f"{flag} {path}: expected a file to write the {what} to, found {found}; fix: {fix}")

    if path.is_dir():
        raise refuse("a folder")
    parent = path.parent
    if not parent.is_dir():
        found = f"no folder {parent}" if not parent.exists() else f"{parent}, which is not a folder"
        raise refuse(found, f"make the folder first (mkdir -p {parent}), or name a file in one that exists")
    read = {(p / REPORT_FILE if p.is_dir() else p).resolve() for p in map(Path, inputs)}
    if path.resolve() in read:
        raise refuse("one of the reports it reads")
    if _is_a_report(path):
        raise refuse(f"a run's {REPORT_FILE} (overwriting it would lose the run)")
    if path.name == REPORT_FILE:
        raise refuse(f"the name of a run's record ({REPORT_FILE}): a reports folder's own file")
    if path.is_file() and not remakes(path):
        run = next((folder for folder in list(path.resolve().parents)[:2] if (folder / REPORT_FILE).is_file()),
                   None)
        if run is not None:
            raise refuse(f"a file of the run in {run} (its evidence: overwriting it would lose it)")
        kind = _schema(path)
        if kind.startswith("stackproof."):
            raise refuse(f"a stackproof {kind} file (overwriting it would lose it)")
    return path


def remade_json(schema: str) -> Callable[[Path], bool]:
    """`remakes` for a command whose output is JSON of `schema` (stackproof.spec/1): the file it made before."""
    return lambda path: _schema(path).split("/")[0] == schema.split("/")[0]


def _schema(path: Path) -> str:
    try:
        existing = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return ""
    return str(existing.get("schema", "")) if isinstance(existing, dict) else ""


def _is_a_report(path: Path) -> bool:
    return _schema(path).startswith("stackproof.report/")


def output_problem(what: str, example: str) -> Callable[[Any], str | None]:
    """`output_file` as a settings check (settings.option(check=...)): the -o of a command whose work takes long
    is refused before the work, not after it (the results lost)."""
    def check(value: Any) -> str | None:
        if value is None:
            return None
        try:
            output_file(Path(value), what, example)
        except ConfigError as err:
            return str(err).removeprefix(f"-o {value}: ")
        return None
    return check
