"""The files people name on the command line: one rule for reading an input and one for every `-o`, each
refusing in one line (exit 2) that says what was expected, what was found and the fix, never an exception's
name. Nothing here creates a folder: a missing one is the person's to make (or to have mistyped)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stackproof.errors import ConfigError


def found_text(err: Exception) -> str:
    """An OSError or a JSON error in words (what the person finds at that path), without the exception's name."""
    if isinstance(err, FileNotFoundError):
        return "no such file"
    if isinstance(err, IsADirectoryError):
        return "a folder"
    if isinstance(err, NotADirectoryError):
        return "a path through something that is not a folder"
    if isinstance(err, PermissionError):
        return "a file this user may not read"
    if isinstance(err, UnicodeDecodeError):
        return "bytes that are not UTF-8 text"
    if isinstance(err, json.JSONDecodeError):
        return f"text that is not JSON ({err.msg} at line {err.lineno} column {err.colno})"
    if isinstance(err, OSError):
        return err.strerror or str(err)
    return str(err)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name}, which is not a number (JSON has no NaN or Infinity)")


def read_text(path: Path, what: str, fix: str, flag: str = "") -> str:
    """The text of an input file, or exit 2: '<flag> PATH: expected WHAT, found no such file; fix: FIX'."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{flag + ' ' if flag else ''}{path}: expected {what}, found {found_text(err)}; "
                          f"fix: {fix}") from None


def read_json(path: Path, what: str, fix: str, flag: str = "", finite: bool = False) -> Any:
    """An input file's JSON, or exit 2 as `read_text`; `finite`: NaN and Infinity refused too (Python's json
    reads them, JSON has none, and no comparison with NaN ever fails)."""
    text = read_text(path, what, fix, flag)
    try:
        return json.loads(text, parse_constant=_no_constants if finite else None)
    except ValueError as err:
        raise ConfigError(f"{flag + ' ' if flag else ''}{path}: expected {what}, found {found_text(err)}; "
                          f"fix: {fix}") from None


def write_text(path: Path, text: str, flag: str = "-o") -> None:
    """Write an output checked by `output_file`; what can still go wrong (a full disk, permissions) in words."""
    try:
        Path(path).write_text(text)
    except OSError as err:
        found = "a file this user may not write" if isinstance(err, PermissionError) else found_text(err)
        raise ConfigError(f"{flag} {path}: expected a file this user can write, found {found}; fix: name a "
                          "writable file") from None


def load_problem(load: Callable[[str], Any], flag: str) -> Callable[[str | None], str | None]:
    """A loader as a settings check (settings.option(check=...)): the file's first problem, or None, so a bad
    --spec or --baseline exits 2 before any rank starts."""
    def check(path: str | None) -> str | None:
        if path is None:
            return None
        try:
            load(path)
        except ConfigError as err:
            return str(err).removeprefix(f"{flag} ")
        return None
    return check


def folder_problem(value: Any) -> str | None:
    """A settings check for a folder the run writes into (--reports): it, and the nearest path above it that
    exists, must be folders, not files. Checked with the setting, so a bad value is blamed on where it came from
    (the flag, or its environment variable), not found later as a failed mkdir. (Whether this user may write
    there is the reports folder's own check, at the run: healthcheck falls back to a folder it can write.)"""
    if value is None:
        return None
    if not str(value).strip():
        return f"expected a non-empty value, found {value!r}"
    path = Path(value)
    nearest = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not nearest.is_dir():
        found = "a file" if nearest == path else f"{nearest}, a file, on the way to it"
        return f"expected a folder (or one to make), found {found}"
    return None
