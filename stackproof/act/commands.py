"""What the healthcheck and the re-proof both do through the scheduler's tool: run one node's commands, say each
step, and give a run a reports folder it can write. Below act/run.py and act/resume.py, so neither imports the
other's insides."""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
from typing import IO

from stackproof.act import kubernetes, slurm
from stackproof.act.config import ActConfig
from stackproof.errors import ActError
from stackproof.run import settle
from stackproof.run.config import ValidateConfig
from stackproof.tools import run_tool

SCHEDULERS = {"slurm": slurm, "kubernetes": kubernetes}  # "none": decide and say, act on nothing


def say_to(out: IO[str]):
    return lambda text: print(f"# stackproof act: {text}", file=out, flush=True)


def run_commands(node: str, commands: list[list[str]], settings: ActConfig, say, failures: list[str]) -> bool:
    """Run one node's commands in order; False (said, and added to `failures`) at the first that fails."""
    scheduler = SCHEDULERS.get(settings.scheduler or "")
    for argv in commands:
        say(f"run: {shlex.join(argv)}")
        try:
            run_tool(f"act on {node}", argv, timeout_s=settings.act_timeout, error=ActError,
                     fix=f"{scheduler.FIX if scheduler else ''} (or raise --act-timeout)")
        except ActError as err:
            failures.append(str(err))
            say(f"FAILED: {err}")
            return False  # this node's later commands build on this one; the next node is tried
    return True


def writable_reports(validate_settings: ValidateConfig, say) -> ValidateConfig:
    """A reports folder that cannot take the run (read-only, full) must not keep a broken node in service: the
    run goes to a private folder instead, and says so."""
    problem = settle.unwritable(validate_settings.reports_dir)
    if problem is None:
        return validate_settings
    private = tempfile.mkdtemp(prefix="stackproof-healthcheck-")
    say(f"the reports folder could not be written ({problem}): this run's report is in {private}; fix: make "
        f"--reports {validate_settings.reports} writable, with room")
    return dataclasses.replace(validate_settings, reports=private)
