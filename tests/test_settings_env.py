"""Every STACKPROOF_* variable the suite reads is a setting (issue 20, item 8): declared once with its flag,
checked at start-up (exit 2: the variable, expected, found, the fix), listed in --help, recorded in report.json's
settings and handed to every rank. And the help says what is true (item 15)."""

import json
import re
from pathlib import Path

from test_reports_folder import run

from stackproof.errors import Exit

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _variables_read() -> set[str]:
    """Every STACKPROOF_* name written in the package and the suite's checks."""
    sources = [*(REPO / "stackproof").rglob("*.py"), *(REPO / "smoke_tests").rglob("*.py")]
    return {name for path in sources for name in re.findall(r"STACKPROOF_[A-Z_]+", path.read_text())}


def test_every_variable_the_suite_reads_is_in_validates_help():
    # ... or in the help of the command that reads it (attest, verify-image: docs/attest.md).
    said = " ".join(" ".join(run(command, "--help").stdout.split()) for command in ("validate", "attest",
                                                                                     "verify-image"))
    names = _variables_read()
    assert {"STACKPROOF_REPORTS", "STACKPROOF_MIN_SHM_BYTES", "STACKPROOF_EXPECT_DECLARED",
            "STACKPROOF_NODE_NAME", "STACKPROOF_LAUNCHED"} <= names
    assert all(name in said for name in names), [name for name in names if name not in said]
    assert "STACKPROOF_MIN_SHM_BYTES (as --min-shm)" in said


def test_a_bad_variable_is_bad_input_at_start_up_naming_it():
    """Before: `STACKPROOF_MIN_SHM_BYTES=junk validate -k host` exited 5, INTERRUPTED, from inside a rank."""
    proc = run("validate", "-k", "host", env_extra={"STACKPROOF_MIN_SHM_BYTES": "junk"})
    assert proc.returncode == Exit.USAGE, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "stackproof: STACKPROOF_MIN_SHM_BYTES='junk': expected a size such as 65536, 64K, 256M or 4G, found 'junk'; "
        "fix: correct STACKPROOF_MIN_SHM_BYTES, unset it, or pass --min-shm (see: stackproof --help)")
    for name, value in [("STACKPROOF_EXPECT_DECLARED", "maybe"), ("STACKPROOF_LAUNCHED", "junk"),
                        ("STACKPROOF_NODE_NAME", " ")]:
        proc = run("validate", "-k", "host", env_extra={name: value})
        assert proc.returncode == Exit.USAGE and f"{name}={value!r}" in proc.stderr, (name, proc.stderr)


def test_a_variable_reaches_every_rank_and_the_report(tmp_path):
    """The value is the ranks' (the host check fails against it) and report.json's settings record it."""
    reports = tmp_path / "reports"
    proc = run("validate", "--reports", reports, "-k", "host",
               env_extra={"STACKPROOF_MIN_SHM_BYTES": "1048576M", "STACKPROOF_NODE_NAME": "node-a7"})
    assert proc.returncode == Exit.FAILED, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((reports / "report.json").read_text())
    assert report["settings"]["min_shm"] == 1048576 * MiB and report["settings"]["node_name"] == "node-a7"
    (shm,) = [c for c in report["checks"] if c["name"] == "host::dev_shm_is_large_enough"]
    assert "expected >= 1048576 MiB (--min-shm, STACKPROOF_MIN_SHM_BYTES)" in shm["message"]
    assert shm["failed_ranks"] == [0, 1] and {r["node"] for r in report["ranks"]} == {"node-a7"}


def test_help_ends_with_the_exit_codes_and_says_the_defaults_in_force():
    """Item 15: `--help` ended with "Exit codes: errors.Exit."; `healthcheck --help` said --tier (default full)."""
    top = " ".join(run("--help").stdout.split())
    assert "errors.Exit" not in top
    assert top.endswith("5 the run was interrupted (Ctrl-C, SIGTERM, docker stop) before every check ran.")
    assert "exit codes: 0 every check ran and passed, 1 a check failed, 2 bad input" in top
    health = " ".join(run("healthcheck", "--help").stdout.split())
    tier = health[health.index("--tier {full,fast} full:"):][:200]
    assert "(default fast)" in tier and "(default full)" not in tier
    validate = " ".join(run("validate", "--help").stdout.split())
    assert "(default full)" in validate[validate.index("--tier {full,fast} full:"):][:200]
