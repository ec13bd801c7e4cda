"""The run's output files, each rendered from the record and replaced atomically: report.json (the record
itself), junit.xml (for CI systems) and stackproof.prom (node_exporter's textfile, report/metrics.py). The
record only holds and reads; this module writes (docs/report-format.md)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from stackproof.errors import Exit
from stackproof.report import metrics
from stackproof.report.record import (
    JUNIT_FILE,
    PROMETHEUS_FILE,
    REPORT_FILE,
    Report,
    ReportUnwritable,
    first_line,
)


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
