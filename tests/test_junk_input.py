"""Junk that was accepted in silence is refused at the settings, exit 2, naming the flag or variable it came
from (issue 30, items 16 and 19): node names that would reach scontrol, kubectl and the breaker's '|'-separated
parse; a /dev/shm bar of 0; a negative timeout or an unknown signal for `verdict`; an endless act timeout;
healthcheck's --skip-busy-gpus given to act; a STACKPROOF_REPORTS that is a file, blamed on the variable.
In-process (stackproof.cli.main): each is refused before anything starts."""

import pytest

from stackproof.cli import main
from stackproof.errors import Exit
from stackproof.settings import parse_signal

# Were one of them accepted, the command would run as small as it can, in a folder of the test's own.
SMALL = {"validate": ["--expect-gpus", "0", "-k", "dev_shm"], "verdict": [], "act": []}


def refused(capsys, monkeypatch, tmp_path, argv, env=None):
    monkeypatch.chdir(tmp_path)
    argv = [argv[0], *SMALL[argv[0]], *argv[1:]]
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    said = capsys.readouterr()
    return code, said.err


JUNK = [
    (["validate", "--node-name", "gpu 7"], None, "--node-name: expected a node name (letters, digits, '.', '_', "
                                                 "'-'; as the scheduler knows the node), found 'gpu 7'"),
    (["validate", "--node-name", "a|b"], None, "found 'a|b'"),
    (["validate", "--node-name", "n1\nn2"], None, "found 'n1\\nn2'"),
    (["validate", "--node-name", "gpu[1-3]"], None, "found 'gpu[1-3]'"),
    (["validate"], {"STACKPROOF_NODE_NAME": "a,b"}, "STACKPROOF_NODE_NAME='a,b': expected a node name"),
    (["act", "--reports", "r", "--scheduler", "none", "--node", "x y"], None, "--node: expected a node name"),
    (["validate", "--min-shm", "0"], None, "--min-shm: expected > 0, found 0"),
    (["verdict", "--reports", "r", "--timed-out", "-5"], None,
     "argument --timed-out: expected seconds in (0, 2592000] (30 days), found -5.0"),
    (["verdict", "--reports", "r", "--interrupted", "NOTASIGNAL"], None,
     "argument --interrupted: expected a signal such as SIGTERM, SIGINT or SIGKILL (or its number), found "
     "'NOTASIGNAL'"),
    (["act", "--reports", "r", "--scheduler", "none", "--act-timeout", "inf"], None,
     "--act-timeout: expected seconds in (0, 2592000] (30 days), found inf"),
    (["act", "--reports", "r", "--scheduler", "none", "--skip-busy-gpus"], None,
     "--skip-busy-gpus: expected only with healthcheck"),
    (["validate"], {"STACKPROOF_REPORTS": "/proc/version"},
     "STACKPROOF_REPORTS='/proc/version': expected a folder (or one to make), found a file; fix: correct "
     "STACKPROOF_REPORTS, unset it, or pass --reports"),
    (["validate", "--reports", "/proc/version/r"], None,
     "--reports: expected a folder (or one to make), found /proc/version, a file, on the way to it"),
    # Issue 36 item 13: accepted without a word.
    (["validate"], {"STACKPROOF_IMAGE_REF": "not a ref"},
     "STACKPROOF_IMAGE_REF='not a ref': expected an image reference REPO@sha256:<64 hex> (or REPO:TAG)"),
    (["validate", "--visible-devices", "abc"], None,
     "--visible-devices: expected GPU indices or UUIDs, comma-separated (0,1 or GPU-8f6a...), found 'abc'"),
    (["validate", "--baseline-tolerance", "0.1"], None,
     "--baseline-tolerance 0.1: expected with --baseline FILE (the figures it loosens), found no --baseline"),
]


@pytest.mark.parametrize(("argv", "env", "words"), JUNK, ids=[" ".join(a) + (f" {e}" if e else "")
                                                             for a, e, _ in JUNK])
def test_junk_is_refused_naming_where_it_came_from(capsys, monkeypatch, tmp_path, argv, env, words):
    code, err = refused(capsys, monkeypatch, tmp_path, argv, env)
    assert code == Exit.USAGE, err
    assert words in err, err
    assert "Traceback" not in err and "File exists" not in err


def test_a_signal_is_named_as_the_launchers_name_it():
    assert parse_signal("SIGTERM") == parse_signal("term") == parse_signal("15") == "SIGTERM"


@pytest.mark.parametrize(("command", "damage", "words"), [
    (["spec"], lambda d: d["tables"].update(per_gpu_facts=[1, 2]),
     "field 'tables.per_gpu_facts': expected a JSON array of objects, found int '1'"),
    (["report"], lambda d: [n.update(gpus=[1, 2]) for n in d["nodes"]],
     "field 'nodes[0].gpus': expected a JSON array of objects, found int '1'"),
])
def test_a_report_of_the_wrong_shape_is_one_line_not_a_traceback(capsys, tmp_path, command, damage, words):
    """Issue 36 item 10: spec and report raised AttributeError on rows that are not objects."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "fixtures" / "spec" / "h200x2-report.json").read_text())
    damage(data)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text(json.dumps(data))
    code = main([*command, str(tmp_path / "run"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == Exit.USAGE and words in err and "fix: " in err and len(err.strip().splitlines()) == 1, err


def test_verdict_takes_a_runs_report_json_as_act_does_and_junk_json_is_named(capsys, tmp_path):
    """Issue 36 item 13: `verdict --reports <run>/report.json` said no such folder; a report.json holding null
    was "found 'a JSON NoneType'"."""
    import json
    import time

    from stackproof.report import outputs
    from stackproof.report.record import Check, Report

    outputs.write(Report(checks=[Check("t.py::x", "passed")], complete=True, started=time.time()), tmp_path / "run")
    assert main(["verdict", "--reports", str(tmp_path / "run" / "report.json")]) == Exit.OK
    assert "# Verdict: OK" in capsys.readouterr().out
    (tmp_path / "null.json").write_text(json.dumps(None))
    assert main(["spec", str(tmp_path / "null.json"), "-o", str(tmp_path / "s.json")]) == Exit.USAGE
    assert "found 'a JSON null'" in capsys.readouterr().err


def test_act_help_lists_no_flag_act_refuses(capsys):
    """Issue 36 item 13: `act --help` listed --skip-busy-gpus, which act refuses; healthcheck's lists it."""
    for command, listed in (("act", False), ("healthcheck", True)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert ("--skip-busy-gpus" in capsys.readouterr().out) == listed, command
