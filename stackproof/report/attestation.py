"""What `stackproof attest` attached for a run, as it leaves it beside report.json (attestation.json): read by
the HTML page and `stackproof verdict`, written by stackproof/images/attest.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORD_FILE = "attestation.json"


def write_record(reports: Path, record: dict[str, Any]) -> Path:
    path = reports / RECORD_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_record(reports: Path) -> dict[str, Any] | None:
    """The record of the attestation made for the run of this reports folder; None when none was made."""
    try:
        record = json.loads((reports / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("reference") else None


def record_line(record: dict[str, Any]) -> str:
    return (f"attested {record.get('reference')}: {record.get('result')} for {record.get('node_class')} at "
            f"{record.get('attested')}")
