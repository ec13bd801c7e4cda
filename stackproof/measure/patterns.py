"""Seeded data patterns for every buffer the suite moves, and the compare that finds the first wrong byte.

A pattern is a function of (seed, byte offset) only, so whoever receives a buffer can rebuild what it must hold
without having been sent it: 64-bit word i of a buffer is (i * PATTERN_STRIDE) XOR seed. Every byte of every word
changes with the seed (its high bytes from the seed, its low bytes from i), consecutive words differ, and a word
written to the wrong place differs from the one expected there. No multiplication overflows int64 (i < 2**31),
so the CPU and every GPU compute the same bits. The seed mixes what moved the buffer (the check, the rank, the
peer, the call): ranks and calls never send each other's data by accident and pass.

Compares are made once per buffer, after the timing, in chunks (a bounded temporary); only a buffer that differs
is searched for its first wrong byte (nonzero on a boolean of the chunk), so a healthy run pays one compare."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

PATTERN_STRIDE = 0x9E3779B1  # 2**32 / golden ratio: consecutive words land far apart in every byte
CHECK_CHUNK_BYTES = 256 << 20  # the temporary a compare builds, at most
WORD = 8


def seed_of(*parts: object) -> int:
    """A 63-bit seed from what moved the buffer (check name, rank, peer, call): stable across processes."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclasses.dataclass(frozen=True)
class WrongBytes:
    """Where a buffer first differs from its pattern, and how much of it does."""
    offset: int  # byte offset of the first wrong byte
    expected: int  # that byte's value, 0..255
    found: int
    wrong: int  # bytes wrong in the chunk the first one was found in (a lower bound for the buffer)
    nbytes: int  # the buffer's size

    def words(self) -> str:
        return (f"byte {self.offset} of {self.nbytes}: expected 0x{self.expected:02x}, found 0x{self.found:02x} "
                f"({self.wrong} byte(s) wrong in the {min(self.nbytes, CHECK_CHUNK_BYTES)} B compared with it)")


def _words(count: int, first: int, seed: int, device: torch.device) -> torch.Tensor:
    words = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return words.mul_(PATTERN_STRIDE).bitwise_xor_(_signed(seed))


def _signed(seed: int) -> int:
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _as_words(buffer: torch.Tensor) -> torch.Tensor:
    flat = buffer.reshape(-1).view(torch.uint8)
    if flat.numel() % WORD:
        raise ValueError(f"a patterned buffer holds whole 8-byte words, got {flat.numel()} B")
    return flat.view(torch.int64)


def fill(buffer: torch.Tensor, seed: int, chunk_bytes: int = CHECK_CHUNK_BYTES) -> torch.Tensor:
    """Write the pattern into a contiguous `buffer` (any dtype, a whole number of words); returns it."""
    words = _as_words(buffer)
    step = max(1, chunk_bytes // WORD)
    for first in range(0, words.numel(), step):
        part = words[first:first + step]
        torch.arange(first, first + part.numel(), dtype=torch.int64, out=part)
        part.mul_(PATTERN_STRIDE).bitwise_xor_(_signed(seed))
    return buffer


def made(nbytes: int, seed: int, device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A new buffer of `nbytes` holding the pattern, viewed as `dtype`."""
    return fill(torch.empty(nbytes, dtype=torch.uint8, device=device), seed).view(dtype)


def first_wrong(buffer: torch.Tensor, seed: int, chunk_bytes: int = CHECK_CHUNK_BYTES) -> WrongBytes | None:
    """None when `buffer` holds the pattern of `seed`; else where it first does not."""
    words = _as_words(buffer)
    step = max(1, chunk_bytes // WORD)
    for first in range(0, words.numel(), step):
        part = words[first:first + step]
        want = _words(part.numel(), first, seed, part.device)
        if not torch.equal(part, want):
            return _locate(part.view(torch.uint8), want.view(torch.uint8), first * WORD, words.numel() * WORD)
    return None


def first_difference(found: torch.Tensor, want: torch.Tensor, chunk_bytes: int = CHECK_CHUNK_BYTES
                     ) -> WrongBytes | None:
    """None when the two buffers hold the same bytes; else where `found` first differs from `want`."""
    got, ref = found.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    if got.numel() != ref.numel():
        raise ValueError(f"buffers of {got.numel()} B and {ref.numel()} B cannot be compared")
    for first in range(0, got.numel(), chunk_bytes):
        part, expected = got[first:first + chunk_bytes], ref[first:first + chunk_bytes]
        if not torch.equal(part, expected):
            return _locate(part, expected, first, got.numel())
    return None


def _locate(part: torch.Tensor, want: torch.Tensor, base: int, nbytes: int) -> WrongBytes:
    bad = part != want
    at = int(bad.nonzero()[0, 0])
    return WrongBytes(base + at, int(want[at]), int(part[at]), int(bad.sum()), nbytes)
