"""Errors meant for people: each names what was expected, what was found, and the fix."""


class StackproofError(Exception):
    """Base class; the CLI prints the message alone (no traceback) and exits with `exit_code`."""

    exit_code = 1


class ConfigError(StackproofError):
    """Bad input (matrix, lock, flags): nothing was built or run."""

    exit_code = 2
