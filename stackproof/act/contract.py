"""healthcheck's exit contract (errors.Healthcheck), kept by the one module that must work when the rest of
stackproof cannot import: the standard library and errors.py only, everything else imported inside `guard`.

`python -m stackproof healthcheck` runs inside `guard`: whatever happens (an import that fails: a missing
dependency, a half-copied install; a bad flag; a crash) it exits Healthcheck.TAKEN_OUT only when the run said
the node was taken out of service, and STAYS otherwise. A healthcheck that could not run says so loudly (a
`stackproof healthcheck: BROKEN` line on stderr) and sets BROKEN_METRIC to 1 in the textfile folder (the
reports folder node_exporter reads); one that ran sets it to 0, so the alert clears once the install is
repaired. scripts/slurm/healthcheck.sh writes the same file when Python cannot even find stackproof."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from stackproof import environment
from stackproof.errors import Exit, Healthcheck

BROKEN_METRIC = "stackproof_healthcheck_broken"
BROKEN_HELP = ("1 when the last stackproof healthcheck on this node could not run (a broken install, a missing "
               "dependency, a bad flag, a crash): the node was not judged and stays in service; 0 when it ran")
BROKEN_FILE = "stackproof-healthcheck.prom"
BAD_INPUT, BAD_INPUT_FIX = "bad input", "correct the flag or setting the line above names (the install is fine)"
# run/config.py's --reports and its variable (tests/test_act_contract.py holds them equal): read here by name,
# because run/config.py may be what cannot be imported.
REPORTS_FLAG, REPORTS_ENV = "--reports", environment.REPORTS.name


def reports_folder(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Path | None:
    """The textfile folder: the run's --reports (the last one given wins, as argparse's), else its variable."""
    found = (environment.current() if env is None else env).get(REPORTS_ENV)
    for i, arg in enumerate(argv):
        if arg == REPORTS_FLAG and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(REPORTS_FLAG + "="):
            found = arg.split("=", 1)[1]
    return Path(found) if found else None


def metric(broken: bool, reason: str = "") -> str:
    """The textfile: one gauge; `reason` (the error's type, or the exit code) as a label when broken."""
    label = reason.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")[:100]
    sample = f'{BROKEN_METRIC}{{reason="{label}"}} 1' if broken else f"{BROKEN_METRIC} 0"
    return f"# HELP {BROKEN_METRIC} {BROKEN_HELP}\n# TYPE {BROKEN_METRIC} gauge\n{sample}\n"


def write_metric(folder: Path | None, broken: bool, reason: str = "") -> str:
    """Write BROKEN_FILE atomically (node_exporter never reads half a file); '' or why it could not be written."""
    if folder is None:
        return f"no {REPORTS_FLAG} folder given, so no {BROKEN_FILE} was written"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        folder = _textfile_folder(folder)
        tmp = folder / f".{BROKEN_FILE}.{os.getpid()}"
        tmp.write_text(metric(broken, reason))
        os.replace(tmp, folder / BROKEN_FILE)
    except OSError as err:
        return f"could not write {folder / BROKEN_FILE}: {err.strerror or err}"
    return ""


def _textfile_folder(root: Path) -> Path:
    """Beside the newest run's stackproof.prom (`latest`, report/folders.py, where node_exporter reads), else root."""
    try:
        from stackproof.report import folders
    except Exception:  # a broken install: the reports folder itself
        return root
    return folders.current(root)


def guard(argv: Sequence[str], main: Callable[[Sequence[str]], int], out: IO[str] | None = None,
          err: IO[str] | None = None) -> int:
    """Run `stackproof healthcheck ARGV` through `main` (the CLI's, which `python -m stackproof` imports inside
    it: an import that crashes is the contract's to report too) and keep the contract."""
    try:
        from stackproof.pipes import keep_exit_code

        keep_exit_code()  # `healthcheck | head -1`: a reader that left is no broken install
    except Exception:  # a half-copied install: the contract holds without it
        pass
    out, err = out or sys.stdout, err or sys.stderr
    folder = reports_folder(argv)
    try:
        code = main(["healthcheck", *argv])
    except SystemExit as stop:  # argparse: --help (0), a bad flag (2, its line already printed)
        if stop.code in (0, None):
            return Healthcheck.STAYS
        return _broken(BAD_INPUT, "bad flags (the line above says which)", folder, out, err, BAD_INPUT_FIX)
    except BaseException as crash:  # the contract holds for anything, Ctrl-C included
        detail = "".join(traceback.format_exception(crash)).rstrip()
        return _broken(type(crash).__name__, detail, folder, out, err)
    if code == Exit.USAGE:  # a flag or setting the CLI refused (its line above): nothing was judged
        return _broken(BAD_INPUT, "bad input (the line above says which)", folder, out, err, BAD_INPUT_FIX)
    if code not in (Healthcheck.STAYS, Healthcheck.TAKEN_OUT):  # the CLI's own error line (exit 1, 4, 5)
        return _broken(f"exit {code}", "the CLI stopped with its own error (the line above)", folder, out, err)
    write_metric(folder, broken=False)
    return Healthcheck(code)


def _broken(reason: str, detail: str, folder: Path | None, out: IO[str], err: IO[str],
            fix: str = "repair the install (this python -m stackproof --version must work)") -> int:
    unwritten = write_metric(folder, broken=True, reason=reason)
    where = unwritten or f"{BROKEN_METRIC}=1 in {_textfile_folder(folder) / BROKEN_FILE}"  # type: ignore[arg-type]
    print(f"{detail}\nstackproof healthcheck: BROKEN: the check could not run ({reason}); this node was not judged; "
          f"{where}; fix: {fix}", file=err, flush=True)
    print(f"# stackproof healthcheck: not run ({reason}); this node stays in service; exit "
          f"{int(Healthcheck.STAYS)}", file=out, flush=True)
    return Healthcheck.STAYS
