"""The files people name on the command line: one rule for reading an input and one for every `-o`, each
refusing in one line (exit 2) that says what was expected, what was found and the fix, never an exception's
name. Nothing here creates a folder: a missing one is the person's to make (or to have mistyped)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
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


def output_file(path: Path, what: str, example: str, inputs: Iterable[Path] = (), flag: str = "-o",
                remakes: Callable[[Path], bool] = lambda _path: False) -> Path:
    """Where a command may write its one output file, checked before any work: a file (new, or one this command
    made before: `remakes`) in a folder that exists, none of the files it reads, and no evidence: no run's
    record, no file of a run's folder (junit.xml, stackproof.prom, attestation.json, rank logs), no other
    stackproof file (a baseline, a spec). Anything else: exit 2, nothing written, no folder made."""
    from stackproof.report.record import REPORT_FILE  # the record imports this module's readers

    path = Path(path)

    def refuse(found: str, fix: str = f"name another file, e.g. {flag} {example}") -> ConfigError:
        return ConfigError(f"{flag} {path}: expected a file to write the {what} to, found {found}; fix: {fix}")

    if path.is_dir():
        raise refuse("a folder")
    parent = path.parent
    if not parent.is_dir():
        found = f"no folder {parent}" if not parent.exists() else f"{parent}, which is not a folder"
        raise refuse(found, f"make the folder first (mkdir -p {parent}), or name a file in one that exists")
    read = {(p / REPORT_FILE if p.is_dir() else p).resolve() for p in map(Path, inputs)}
    if path.resolve() in read:
        raise refuse("one of the reports it reads")
    if _is_a_report(path):
        raise refuse(f"a run's {REPORT_FILE} (overwriting it would lose the run)")
    if path.name == REPORT_FILE:
        raise refuse(f"the name of a run's record ({REPORT_FILE}): a reports folder's own file")
    if path.is_file() and not remakes(path):
        run = next((folder for folder in list(path.resolve().parents)[:2] if (folder / REPORT_FILE).is_file()),
                   None)
        if run is not None:
            raise refuse(f"a file of the run in {run} (its evidence: overwriting it would lose it)")
        kind = _schema(path)
        if kind.startswith("stackproof."):
            raise refuse(f"a stackproof {kind} file (overwriting it would lose it)")
    return path


def remade_json(schema: str) -> Callable[[Path], bool]:
    """`remakes` for a command whose output is JSON of `schema` (stackproof.spec/1): the file it made before."""
    return lambda path: _schema(path).split("/")[0] == schema.split("/")[0]


def _schema(path: Path) -> str:
    try:
        existing = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return ""
    return str(existing.get("schema", "")) if isinstance(existing, dict) else ""


def _is_a_report(path: Path) -> bool:
    return _schema(path).startswith("stackproof.report/")


def write_text(path: Path, text: str, flag: str = "-o") -> None:
    """Write an output checked by `output_file`; what can still go wrong (a full disk, permissions) in words."""
    try:
        Path(path).write_text(text)
    except OSError as err:
        found = "a file this user may not write" if isinstance(err, PermissionError) else found_text(err)
        raise ConfigError(f"{flag} {path}: expected a file this user can write, found {found}; fix: name a "
                          "writable file") from None


def output_problem(what: str, example: str) -> Callable[[Any], str | None]:
    """`output_file` as a settings check (settings.option(check=...)): the -o of a command whose work takes long
    is refused before the work, not after it (the results lost)."""
    def check(value: Any) -> str | None:
        if value is None:
            return None
        try:
            output_file(Path(value), what, example)
        except ConfigError as err:
            return str(err).removeprefix(f"-o {value}: ")
        return None
    return check


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
