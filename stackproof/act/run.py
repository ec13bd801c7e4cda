"""`stackproof act` and `stackproof healthcheck`: a run's verdict in, the scheduler's actions out. What acts and
what does not is decide.py's; this prints each action and performs it through the scheduler's tool."""

from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
from typing import IO

from stackproof.act import decide, kubernetes, slurm, tool
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.suite.config import ValidateConfig
from stackproof.suite.identity import NODE_NAME_ENV
from stackproof.tools import run_tool

SCHEDULERS = {"slurm": slurm, "kubernetes": kubernetes}  # "none": decide and say, act on nothing


def act(decision: decide.Decision, settings: ActConfig, out: IO[str]) -> None:
    """Perform the decision through settings.scheduler's tool, saying each step on `out` ('#' lines). The first
    command that fails raises tool.ActError (exit 2), naming the fix."""
    scheduler = SCHEDULERS.get(settings.scheduler or "")
    say = lambda text: print(f"# stackproof act: {text}", file=out, flush=True)  # noqa: E731
    say(decision.summary())
    for action in decision.actions:
        if action.failed:
            say(f"{action.node}: {action.reason}")
        for argv in scheduler.commands(action) if scheduler else []:
            say(f"run: {shlex.join(argv)}")
            run_tool(f"act on {action.node}", argv, timeout_s=settings.act_timeout, error=tool.ActError,
                     fix=f"{scheduler.FIX} (or raise --act-timeout)")


def act_on_reports(reports_dir, settings: ActConfig, out: IO[str]) -> int:
    """`stackproof act --reports DIR`: a finished (multi-node) run. Exit 0 when done as the policy says (acting or
    not); 2 when the report cannot be read or the action failed."""
    decision = decide.decide(decide.load(reports_dir), max_nodes=settings.max_nodes)
    if settings.node:
        decision = dataclasses.replace(decision, actions=tuple(a for a in decision.actions if a.node == settings.node))
    act(decision, settings, out)
    return Exit.OK


def bad_input(err: ConfigError, out: IO[str]) -> int:
    """Bad input: nothing ran, so there is nothing to act on (decide.py's policy)."""
    print(f"stackproof: {err}", file=out, flush=True)
    print(f"# stackproof act: not acted on: exit code {int(Exit.USAGE)} ({Exit.USAGE.meaning}) says nothing "
          "about the machine", file=out, flush=True)
    return Exit.USAGE


def healthcheck(validate_settings: ValidateConfig, settings: ActConfig, out: IO[str]) -> int:
    """Validate this node, then act on what the run found. Exit: validate's code (0 passed, 1 failed and acted
    on, 2/3/4/5 reported only), or 2 when the action itself failed."""
    from stackproof.suite.launcher import validate

    if settings.node:
        # The ranks are other processes: they learn the node's scheduler name the way pods do (identity.py).
        os.environ[NODE_NAME_ENV[0]] = settings.node
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    try:
        code = validate(validate_settings)
    except ConfigError as err:
        return bad_input(err, out)
    try:
        report = decide.load(validate_settings.reports_dir)
    except ConfigError as err:
        print(f"# stackproof act: not acted on: {err}", file=out, flush=True)
        return int(code)
    act(decide.decide(report, exit_code=int(code), not_before=started, max_nodes=settings.max_nodes), settings,
        out)
    return int(code)
