"""Running a scheduler's own tool (scontrol, kubectl): with a timeout, and an error that names the fix."""

from __future__ import annotations

import shlex
import shutil
import subprocess

from stackproof.errors import ConfigError


class ActError(ConfigError):
    """The action itself failed (tool missing, refused, timed out): the node was NOT acted on. Exit 2, as bad
    input: the settings or the permissions of the machine running stackproof need a fix, not the node."""


def run(argv: list[str], *, timeout_s: float, fix: str) -> str:
    """Run `argv`; its stdout. Raises ActError naming the command, what it said, and `fix`."""
    if not shutil.which(argv[0]):
        raise ActError(f"expected `{argv[0]}` on PATH to run `{shlex.join(argv)}`, found none; fix: {fix}")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ActError(f"`{shlex.join(argv)}` did not answer within {timeout_s:g} s (--act-timeout); fix: {fix}")\
            from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().replace("\n", " ")[-400:]
        raise ActError(f"`{shlex.join(argv)}` exited {proc.returncode}: {said or '(no output)'}; fix: {fix}")
    return proc.stdout
