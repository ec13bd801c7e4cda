"""Running another well-kept tool (scontrol, kubectl, docker, skopeo, cosign): with a timeout, and an error that
names the step, the command, what it said and the fix."""

from __future__ import annotations

import shlex
import shutil
import subprocess

from stackproof.errors import StackproofError


def run_tool(step: str, argv: list[str], *, timeout_s: float, fix: str, error: type[StackproofError],
             missing_fix: str | None = None, **kwargs) -> str:
    """Run `argv`; its stdout. Any failure raises `error` (its exit code is the caller's: a failed push is not
    bad input); `missing_fix` is the fix when the tool is not installed at all (default: `fix`). A tool that
    exited non-zero: the error's `said` is everything it printed."""
    command = shlex.join(argv)
    if not shutil.which(argv[0]):
        raise error(f"{step}: expected `{argv[0]}` on PATH to run `{command}`, found none; fix: {missing_fix or fix}")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except subprocess.TimeoutExpired:
        raise error(f"{step}: `{command}` did not finish within {timeout_s:g} s; fix: {fix}") from None
    if proc.returncode != 0:
        # One line (errors are one line): the tool's last few lines, where it says what failed.
        said = " | ".join([line.strip() for line in (proc.stderr.strip() or proc.stdout.strip()).splitlines()
                           if line.strip()][-3:])[-1000:]
        failed = error(f"{step}: `{command}` exited {proc.returncode}: {said or '(no output)'}; fix: {fix}")
        failed.said = proc.stderr + proc.stdout  # all it said, for a caller that tells its failures apart
        raise failed
    return proc.stdout
