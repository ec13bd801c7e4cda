"""A reader that leaves early (`stackproof validate | head -1`) changes neither what a command does nor its exit
code: what is written after it left goes nowhere, as with a shell's own commands. Standard library only: the
healthcheck contract (act/contract.py) installs it before anything else can fail."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Any


class ReaderMayLeave:
    """A text stream whose closed reader (EPIPE) is not an error: the stream's descriptor is pointed at
    /dev/null, so this process and what it starts later write on without one."""

    def __init__(self, stream: IO[str]):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # closed all the same; only its last lines were lost
            self._stream.close()

    def _reader_left(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def reader_may_leave(stream: IO[str]) -> IO[str]:
    return stream if isinstance(stream, ReaderMayLeave) else ReaderMayLeave(stream)  # type: ignore[return-value]


def keep_exit_code() -> None:
    """sys.stdout and sys.stderr as ReaderMayLeave streams (at every command's entry)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None:
            setattr(sys, name, reader_may_leave(stream))
