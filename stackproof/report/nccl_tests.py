"""nccl-tests' stdout (e.g. all_reduce_perf) as rows: its output is a contract. '#' lines are comments; the
column header ('#  size  count  type  redop  root  time  algbw  busbw  #wrong  time ...') names the columns, the
first time/algbw/busbw group out-of-place, the second in-place (src/util.cu). Any other line (NCCL INFO logs,
warnings) is not data."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stackproof import files
from stackproof.errors import ConfigError

# The columns of nccl-tests 2.x when no header was captured (e.g. a pasted excerpt).
DEFAULT_HEADER = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                  "time", "algbw", "busbw", "#wrong"]


@dataclasses.dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    dtype: str
    redop: str
    out_of_place: tuple[float, float, float] | None  # time (us), algbw, busbw (GB/s); None in trace replays
    in_place: tuple[float, float, float]


def _group(tokens: list[str], header: list[str], nth: int) -> tuple[float, float, float] | None:
    """The nth (0: out-of-place, 1: in-place) time/algbw/busbw triple, by the header's column positions."""
    starts = [i for i, name in enumerate(header) if name in ("time", "cputime")]
    if nth >= len(starts) or starts[nth] + 2 >= len(tokens):
        return None
    try:
        return tuple(float(tokens[starts[nth] + j]) for j in range(3))  # type: ignore[return-value]
    except ValueError:
        return None


def parse(text: str) -> list[Row]:
    header = DEFAULT_HEADER
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            names = line.lstrip("#").split()
            if names[:2] == ["size", "count"]:
                header = names
            continue
        tokens = line.split()
        if len(tokens) < 8 or not (tokens[0].isdigit() and tokens[1].isdigit()):
            continue
        out_of_place, in_place = _group(tokens, header, 0), _group(tokens, header, 1)
        if in_place is None and out_of_place is not None and len(tokens) < len(header):
            # Trace replay prints a blank out-of-place group: the only triple there is the in-place one.
            out_of_place, in_place = None, out_of_place
        if in_place is None:
            continue
        rows.append(Row(int(tokens[0]), int(tokens[1]), tokens[2], tokens[3], out_of_place, in_place))
    return rows


def read(path: Path) -> list[Row]:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ConfigError(f"--reference {path}: expected nccl-tests' output, found {files.found_text(err)}; fix: "
                          "name the file all_reduce_perf's stdout was saved to (all_reduce_perf ... > FILE)") from None
    rows = parse(text)
    if not rows:
        raise ConfigError(f"--reference {path}: expected nccl-tests' data lines (size count type redop root time "
                          "algbw busbw #wrong time algbw busbw #wrong), found none; fix: save all_reduce_perf's "
                          "stdout as it is (e.g. all_reduce_perf -b 8 -e 4G -f 2 -g 1 > FILE)")
    return rows
