"""One rule for the files people name (stackproof/files.py): every `-o` (spec, baseline, report, bench resnet) is
checked before any work, in a folder that exists (none is made), and never over a run's report.json; every
missing or unreadable input says what was expected, what was found and the fix, without an exception's name.
The CLI runs in-process (stackproof.cli.main), as a person would call it, with its exit code and stderr."""

import json
import time
from pathlib import Path

import pytest

from stackproof.cli import main
from stackproof.errors import Exit

FIXTURE = Path(__file__).parent / "fixtures" / "spec" / "h200x2-report.json"  # a passing GPU run's report.json
COMMANDS = {  # command -> (its argv before -o, the example file its fix names)
    "spec": (["spec", str(FIXTURE)], "spec.json"),
    "baseline": (["baseline", str(FIXTURE)], "baseline.json"),
    "report": (["report", str(FIXTURE)], "page.html"),
    "bench": (["bench", "resnet", "--nproc", "1"], "resnet.json"),
}


def run(capsys, *argv):
    try:
        code = main(list(map(str, argv)))
    except SystemExit as exit_:  # argparse, and a settings check at parse time
        code = exit_.code
    said = capsys.readouterr()
    return code, said.out, said.err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_in_a_missing_folder_is_refused_first_and_no_folder_is_made(capsys, tmp_path, command):
    argv, _ = COMMANDS[command]
    target = tmp_path / "no" / "such" / "out.json"
    started = time.monotonic()
    code, out, err = run(capsys, *argv, "-o", target)
    assert code == Exit.USAGE, err
    assert f"found no folder {target.parent}; fix: make the folder first (mkdir -p {target.parent})" in err, err
    assert "Traceback" not in err and "Error" not in err
    assert not (tmp_path / "no").exists()
    assert "# ran" not in out and time.monotonic() - started < 30  # bench: refused before any benchmark


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_is_a_folder_or_a_runs_report_is_refused_and_kept(capsys, tmp_path, command):
    argv, example = COMMANDS[command]
    code, _, err = run(capsys, *argv, "-o", tmp_path)
    assert code == Exit.USAGE and "found a folder; fix: name another file, e.g. -o " + example in err, err
    disguised = tmp_path / "results.json"
    disguised.write_text(FIXTURE.read_text())
    code, _, err = run(capsys, *argv, "-o", disguised)
    assert code == Exit.USAGE and "found a run's report.json (overwriting it would lose the run)" in err, err
    assert disguised.read_text() == FIXTURE.read_text()
    named = tmp_path / "r" / "report.json"
    named.parent.mkdir()
    code, _, err = run(capsys, *argv, "-o", named)
    assert code == Exit.USAGE and "found the name of a run's record (report.json)" in err, err
    assert not named.exists()


@pytest.mark.parametrize("command", ["spec", "baseline", "report"])
def test_an_output_that_is_a_runs_evidence_or_another_stackproof_file_is_refused_and_kept(capsys, tmp_path,
                                                                                           command):
    """Issue 36 item 9: -o replaced a run's junit.xml, stackproof.prom, attestation.json, rank logs, or a baseline
    file, without a word; only report.json was protected. What the command made before it may make again."""
    argv, _ = COMMANDS[command]
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "report.json").write_text(FIXTURE.read_text())
    evidence = [run_dir / name for name in ("junit.xml", "stackproof.prom", "attestation.json", "logs/rank0.log")]
    baseline = tmp_path / "baseline.json"
    spec = tmp_path / "h200.spec.json"
    assert run(capsys, "baseline", FIXTURE, "-o", baseline)[0] == 0
    assert run(capsys, "spec", FIXTURE, "-o", spec)[0] == 0
    for path in evidence:
        path.write_text("evidence\n")
    mine = {"spec": spec, "baseline": baseline, "report": tmp_path / "page.html"}[command]
    for path in [*evidence, *(p for p in (baseline, spec) if p != mine)]:
        kept = path.read_text()
        code, _, err = run(capsys, *argv, "-o", path)
        assert code == Exit.USAGE and len(err.strip().splitlines()) == 1, err
        assert ("(its evidence: overwriting it would lose it)" in err or "file (overwriting it would lose it)"
                in err) and "fix: name another file" in err, err
        assert path.read_text() == kept
    for _ in range(2):  # made again: its own file
        code, _, err = run(capsys, *argv, "-o", mine)
        assert code == 0, err


def test_an_output_in_a_folder_that_exists_is_written(capsys, tmp_path):
    code, _, err = run(capsys, "spec", FIXTURE, "-o", tmp_path / "h200.spec.json")
    assert code == 0, err
    assert json.loads((tmp_path / "h200.spec.json").read_text())["schema"] == "stackproof.spec/1"


@pytest.mark.parametrize("command", ["spec", "baseline", "report"])
def test_a_missing_report_says_so_and_the_fix(capsys, tmp_path, command):
    missing = tmp_path / "nope" / "report.json"
    code, _, err = run(capsys, command, missing, "-o", tmp_path / "out")
    assert code == Exit.USAGE, err
    assert (f"{missing}: expected a finished run's report.json, found no such file; fix: point at the folder "
            "`stackproof validate --reports DIR` wrote, or its report.json") in err, err
    assert "Error" not in err and "Errno" not in err


def test_a_missing_baseline_spec_or_reference_says_so_and_the_fix(capsys, tmp_path):
    code, _, err = run(capsys, "validate", "--expect-gpus", "0", "--reports", tmp_path / "r",
                       "--baseline", tmp_path / "b.json", "--spec", tmp_path / "s.json")
    assert code == Exit.USAGE, err
    assert "b.json: expected a baseline JSON made by `stackproof baseline`, found no such file; fix: name" in err
    assert "s.json: expected a node spec JSON made by `stackproof spec`, found no such file; fix: name" in err
    code, _, err = run(capsys, "report", FIXTURE, "-o", tmp_path / "p.html", "--reference", tmp_path / "ref.txt")
    assert code == Exit.USAGE and "ref.txt: expected nccl-tests' output, found no such file; fix: name" in err, err
    assert "Error" not in err and "Errno" not in err
    assert not (tmp_path / "p.html").exists()


def test_an_unknown_image_names_the_known_ones_and_the_fix(capsys):
    code, _, err = run(capsys, "images", "check", "--offline", "nosuchimage")
    assert code == Exit.USAGE
    assert "image 'nosuchimage': not in matrix.toml; known images: " in err
    assert "fix: name one of them (stackproof images list)" in err
