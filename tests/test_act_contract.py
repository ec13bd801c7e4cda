"""healthcheck's exit contract, with real broken installs in real processes: a Python with no stackproof (a venv
without it), a stackproof that is missing one of its own modules (a half-copied install), a dependency that is
missing (a venv without pytest). None of them exits TAKEN_OUT; each says BROKEN loudly and leaves
stackproof_healthcheck_broken 1 in the textfile folder; Slurm's wrapper (healthcheck.sh) turns TAKEN_OUT, and only
it, into 1. The code is written once (errors.Healthcheck): the scripts, --help and docs/act.md are held to it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from stackproof.act import contract
from stackproof.cli import build_parser
from stackproof.errors import HEALTHCHECK_EXIT_HELP, Exit, Healthcheck
from stackproof.run.config import REPORTS_ENV, ValidateConfig

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
HEALTHCHECK_SH = REPO / "scripts" / "slurm" / "healthcheck.sh"
DAEMONSET = REPO / "scripts" / "kubernetes" / "daemonset.yaml"
TAKEN_OUT = int(Healthcheck.TAKEN_OUT)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "STACKPROOF_", "PYTHON"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


# --- the code, written once ---------------------------------------------------------------------------------

def test_taken_out_is_a_code_no_crash_gives():
    crash_codes = {1, 2, 126, 127} | {128 + n for n in range(1, 65)} | {int(code) for code in Exit}
    assert TAKEN_OUT not in crash_codes and 0 < TAKEN_OUT < 126
    assert Healthcheck.STAYS == 0


def test_the_scripts_help_and_docs_say_the_same_code():
    assert re.search(rf"^TAKEN_OUT={TAKEN_OUT}\b", HEALTHCHECK_SH.read_text(), re.MULTILINE)
    assert re.search(rf"^\s+TAKEN_OUT={TAKEN_OUT}\b", DAEMONSET.read_text(), re.MULTILINE)
    for script in (HEALTHCHECK_SH, DAEMONSET):
        text = script.read_text()
        assert contract.BROKEN_METRIC in text and (contract.BROKEN_FILE in text or script == DAEMONSET)
    action = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    assert HEALTHCHECK_EXIT_HELP in " ".join(action.choices["healthcheck"].description.split())
    docs = " ".join((REPO / "docs" / "act.md").read_text().split())
    assert f"exits **{TAKEN_OUT}" in docs and contract.BROKEN_METRIC in docs


def test_the_contract_reads_the_reports_flag_and_variable_the_settings_declare():
    assert REPORTS_ENV == contract.REPORTS_ENV and ValidateConfig.environment()[REPORTS_ENV] == contract.REPORTS_FLAG
    assert contract.reports_folder(["--reports", "a", "--reports=b"], {}) == Path("b")
    assert contract.reports_folder([], {REPORTS_ENV: "/r"}) == Path("/r")
    assert contract.reports_folder([], {}) is None


# --- the guard, in process: any crash or odd code is STAYS ------------------------------------------------

@pytest.mark.parametrize(("main", "reason"), [
    (lambda argv: (_ for _ in ()).throw(ModuleNotFoundError("No module named 'pynvml'")), "ModuleNotFoundError"),
    (lambda argv: 1 // 0, "ZeroDivisionError"),
    (lambda argv: (_ for _ in ()).throw(KeyboardInterrupt()), "KeyboardInterrupt"),
    (lambda argv: 1, "exit 1"),  # the CLI's own error line (a StackproofError)
    (lambda argv: 4, "exit 4"),
])
def test_whatever_goes_wrong_the_guard_exits_stays_and_counts_it(tmp_path, capsys, main, reason):
    code = contract.guard(["--reports", str(tmp_path)], main=main)
    assert code == Healthcheck.STAYS
    err = capsys.readouterr().err
    assert f"stackproof healthcheck: BROKEN: the check could not run ({reason})" in err
    assert f'{contract.BROKEN_METRIC}{{reason="{reason}"}} 1' in (tmp_path / contract.BROKEN_FILE).read_text()


def test_a_run_that_ran_clears_the_metric_and_keeps_its_code(tmp_path):
    assert contract.guard(["--reports", str(tmp_path)], main=lambda argv: TAKEN_OUT) == Healthcheck.TAKEN_OUT
    assert f"{contract.BROKEN_METRIC} 0" in (tmp_path / contract.BROKEN_FILE).read_text()
    assert contract.guard(["--reports", str(tmp_path)], main=lambda argv: 0) == Healthcheck.STAYS


# --- real broken installs, in real processes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A real venv of this Python with nothing installed: no stackproof, no pytest."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    return where / "bin" / "python"


def test_a_python_without_stackproof_never_drains_through_healthcheck_sh(tmp_path, bare_venv):
    """Slurm's wrapper with STACKPROOF_PYTHON a venv that lacks stackproof: `No module named stackproof`, exit 1
    from Python; the wrapper says BROKEN, writes the metric, and exits 0 (a drain would be 1)."""
    proc = subprocess.run(["bash", str(HEALTHCHECK_SH)], capture_output=True, text=True, timeout=60,
                          env=_clean_env(STACKPROOF_PYTHON=str(bare_venv), STACKPROOF_NODE_NAME="n1",
                                         STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path),
                                         STACKPROOF_HEALTHCHECK_CONF="/nonexistent"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No module named stackproof" in proc.stdout + proc.stderr
    assert "stackproof healthcheck: BROKEN" in proc.stderr
    assert f'{contract.BROKEN_METRIC}{{reason="exit 1"}} 1' in (tmp_path / "n1" / contract.BROKEN_FILE).read_text()
    assert "# exit 0 (stackproof healthcheck exited 1)" in (tmp_path / "n1" / "healthcheck.log").read_text()


def test_a_stackproof_missing_one_of_its_modules_exits_0_loudly(tmp_path):
    """A half-copied install: stackproof/ without run/config.py. The import of the CLI fails inside the guard."""
    shutil.copytree(REPO / "stackproof", tmp_path / "site" / "stackproof",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "site" / "stackproof" / "run" / "config.py").unlink()
    proc = subprocess.run([sys.executable, "-m", "stackproof", "healthcheck", "--scheduler", "slurm",
                           "--reports", str(tmp_path / "reports")], capture_output=True, text=True, timeout=60,
                          env=_clean_env(PYTHONPATH=str(tmp_path / "site")), cwd=tmp_path)
    assert proc.returncode == Healthcheck.STAYS, proc.stdout + proc.stderr
    assert "No module named 'stackproof.run.config'" in proc.stderr
    assert "BROKEN: the check could not run (ModuleNotFoundError)" in proc.stderr
    assert "this node stays in service; exit 0" in proc.stdout
    metric = (tmp_path / "reports" / contract.BROKEN_FILE).read_text()
    assert f'{contract.BROKEN_METRIC}{{reason="ModuleNotFoundError"}} 1' in metric


def test_a_missing_dependency_never_takes_the_node_out(tmp_path, bare_venv):
    """stackproof importable (PYTHONPATH), but the venv has no pytest (nor torch): the run cannot judge the node,
    whatever layer notices; the exit is 0, never TAKEN_OUT, and a fault everywhere would read the same."""
    proc = subprocess.run([str(bare_venv), "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n1",
                           "--expect-gpus", "0", "--nproc", "1", "-k", "barrier", "--reports",
                           str(tmp_path / "reports"), "--run-timeout", "60", "--timeout", "30"],
                          capture_output=True, text=True, timeout=120,
                          env=_clean_env(PYTHONPATH=str(REPO)), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == Healthcheck.STAYS, out[-4000:]
    assert "No module named" in out and "this node stays in service" in out, out[-4000:]


def test_healthcheck_sh_maps_only_taken_out_to_1(tmp_path):
    """The wrapper around a stand-in `python` that exits each code: only TAKEN_OUT drains (1)."""
    for code, expected in ((0, 0), (1, 0), (2, 0), (4, 0), (127, 0), (137, 0), (TAKEN_OUT, 1)):
        fake = tmp_path / f"python{code}"
        fake.write_text(f"#!/bin/sh\nexit {code}\n")
        fake.chmod(0o755)
        proc = subprocess.run(["bash", str(HEALTHCHECK_SH)], capture_output=True, text=True, timeout=60,
                              env=_clean_env(STACKPROOF_PYTHON=str(fake), STACKPROOF_NODE_NAME="n1",
                                             STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path / "r"),
                                             STACKPROOF_HEALTHCHECK_CONF="/nonexistent"), cwd=tmp_path)
        assert proc.returncode == expected, (code, proc.stdout, proc.stderr)
        assert ("BROKEN" in proc.stderr) == (code not in (0, TAKEN_OUT)), (code, proc.stderr)


def test_the_broken_metric_passes_promtool_lint(tmp_path):
    """Both writers' textfiles (the guard's and healthcheck.sh's) are valid exposition format."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (CI installs prometheus)")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    subprocess.run(["bash", str(HEALTHCHECK_SH)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                   env=_clean_env(STACKPROOF_PYTHON=str(fake), STACKPROOF_NODE_NAME="n1",
                                  STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path / "r"),
                                  STACKPROOF_HEALTHCHECK_CONF="/nonexistent"))
    for text in (contract.metric(True, 'Module"NotFound'), contract.metric(False),
                 (tmp_path / "r" / "n1" / contract.BROKEN_FILE).read_text()):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=60)
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), (text, lint.stdout + lint.stderr)


def test_a_dry_run_as_a_prolog_never_drains_through_slurms_prolog_error(tmp_path):
    """--scheduler none drained nothing: its TAKEN_OUT ("would be taken out") is 0 for slurmd, whether the flag
    comes as an argument or from STACKPROOF_HEALTHCHECK_ARGS (issue 33: before, 1, and a Prolog's 1 drains)."""
    fake = tmp_path / "python86"
    fake.write_text(f"#!/bin/sh\nexit {TAKEN_OUT}\n")
    fake.chmod(0o755)
    for argv, more, expected in (([], "", 1), (["--scheduler", "none"], "", 0), (["--scheduler=none"], "", 0),
                                 ([], "--max-drained 2 --scheduler none", 0),
                                 (["--scheduler", "slurm"], "--scheduler none", 1)):  # the last one given wins
        proc = subprocess.run(["bash", str(HEALTHCHECK_SH), *argv], capture_output=True, text=True, timeout=60,
                              env=_clean_env(STACKPROOF_PYTHON=str(fake), STACKPROOF_NODE_NAME="n1",
                                             STACKPROOF_HEALTHCHECK_REPORTS=str(tmp_path / "r"),
                                             STACKPROOF_HEALTHCHECK_ARGS=more,
                                             STACKPROOF_HEALTHCHECK_CONF="/nonexistent"), cwd=tmp_path)
        assert proc.returncode == expected, (argv, more, proc.stdout, proc.stderr)
        assert ("a dry run (--scheduler none) would have taken" in proc.stdout) == (expected == 0), proc.stdout
