"""Exit codes and errors meant for people: each error names what was expected, what was found, and the fix.

Every exit code of stackproof is written here once; the CLI, the launcher, the report and the scripts (through
`stackproof verdict`) all take them from `Exit`."""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NO_GPU = 3
    INCOMPLETE = 4
    INTERRUPTED = 5

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]

    @property
    def verdict(self) -> str:
        return {Exit.OK: "OK", Exit.INTERRUPTED: "INTERRUPTED"}.get(self, "FAILED")


_MEANINGS = {
    Exit.OK: "every check ran and passed",
    Exit.FAILED: "a check failed",
    Exit.USAGE: "bad input (flags, settings, files, matrix or lock): nothing was judged",
    Exit.NO_GPU: "no GPU visible, but GPUs were expected",
    Exit.INCOMPLETE: "the run did not complete: a rank died or timed out, or what it promises was not judged",
    Exit.INTERRUPTED: "the run was interrupted (Ctrl-C, SIGTERM, docker stop) before every check ran",
}


class Healthcheck(enum.IntEnum):
    """`stackproof healthcheck`'s exit codes: the scheduler's contract (docs/act.md). TAKEN_OUT is a code that no
    crash gives (Python's uncaught exception and `No module named ...` exit 1, argparse 2, bash 126/127, a signal
    128+N, validate 0-5): the Slurm and Kubernetes wrappers take a node out for it alone, so a broken install, a
    missing python or a bug can never drain a fleet. scripts/slurm/healthcheck.sh and
    scripts/kubernetes/daemonset.yaml spell it (a shell cannot import this); tests/test_act_contract.py holds
    them to it."""

    STAYS = 0
    TAKEN_OUT = 86  # "to 86": to take out of service

    @property
    def meaning(self) -> str:
        return {Healthcheck.STAYS: "this node stays in service (a pass, an alert, a withheld drain, bad input, the "
                                   "tool's own failure: the reason is on stdout)",
                Healthcheck.TAKEN_OUT: "this node was taken out of service (drained / tainted, or would be with "
                                       "--scheduler none)"}[self]


HEALTHCHECK_EXIT_HELP = ("exit codes (the scheduler's contract): " +
                         ", ".join(f"{int(code)} {code.meaning}" for code in Healthcheck) +
                         "; any other code (a crash, a broken install) is the tool's, never the node's")


class StackproofError(Exception):
    """Base class; the CLI prints the message alone (no traceback) and exits with `exit_code`."""

    exit_code = Exit.FAILED
    said = ""  # all that a failed tool printed (stackproof/tools.py), for a caller that tells failures apart


class ConfigError(StackproofError):
    """Bad input (matrix, lock, flags): nothing was built or run."""

    exit_code = Exit.USAGE


class ActError(ConfigError):
    """Acting on a node failed (the scheduler's tool missing, refused, timed out): the node was NOT acted on. Exit 2,
    as bad input: the settings or the permissions of the machine running stackproof need a fix, not the node."""


class RankTimeout(StackproofError):
    """Some ranks did not reach a sync point in time: the run cannot go on. `ranks` names them."""

    exit_code = Exit.INCOMPLETE

    def __init__(self, message: str, ranks: list[int] | tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = list(ranks)
