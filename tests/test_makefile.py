"""`make test` on a fresh clone brings up what it needs: the .venv (made by `make dev`) is a prerequisite of every
target that runs the project's python, made once and again only when pyproject.toml or the matrix change."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from stackproof.images.matrix import REPO_ROOT

pytestmark = pytest.mark.skipif(not shutil.which("make"), reason="no make")


def clone(tmp_path):
    """The files make reads, without .venv: what a fresh clone has."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, repo)
    shutil.copytree(REPO_ROOT / "images", repo / "images")
    return repo


def dry_run(repo, *args):
    # As a user's shell would run it, also when these tests run under `make test` (no outer make's flags).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=repo, capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("target", ["test", "check", "lint", "validate"])
def test_a_fresh_clone_makes_the_venv_first(tmp_path, target):
    lines = dry_run(clone(tmp_path), target)
    made = next(i for i, line in enumerate(lines) if line.endswith("-m venv .venv"))
    uses = next(i for i, line in enumerate(lines) if line.startswith(".venv/bin/python -m ") and "pip" not in line)
    assert made < uses, lines
    assert any("pip install" in line and "-e '.[dev]'" in line for line in lines), lines


def test_the_venv_is_made_once(tmp_path):
    repo = clone(tmp_path)
    stamp = repo / ".venv" / ".stackproof-dev"
    stamp.parent.mkdir()
    stamp.touch()
    lines = dry_run(repo, "test")
    assert lines == [".venv/bin/python -m pytest --numprocesses=2"], lines
    later = time.time() + 10
    os.utime(repo / "images" / "matrix.toml", (later, later))  # the image's torch may have changed
    assert any(line.endswith("-m venv .venv") for line in dry_run(repo, "test"))


def test_another_python_needs_no_venv(tmp_path):
    one_process = dry_run(clone(tmp_path), "test", "PYTHON=python3", "TEST_WORKERS=0")
    assert one_process == ["python3 -m pytest --numprocesses=0"], one_process
