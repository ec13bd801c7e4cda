"""A memory test over most of the GPU's free memory, as DCGM's memory test does (dcgmi diag's "memory" plugin
writes and reads patterns over the framebuffer), sized to cost a fraction of a second: the memory is taken in
chunks (what a fragmented allocator can still give), every chunk is written with each pattern and read back.

Patterns, each a different kind of fault:
  address   every 8-byte word holds its own index on the GPU (a word written to or read from the wrong address,
            a stuck address line, one chunk aliasing another)
  walking   a 128-word period of one bit set (walking ones) then one bit clear (walking zeros): every data
            line stuck at 0 or at 1, and lines shorted together
  random    a random 16 MiB tile, a new one per chunk (data-dependent faults the regular patterns miss)
Writes and compares run at HBM speed (about 8 passes over the memory in all): 120 GiB on an H200 in ~0.3 s.
Only a chunk that differs is searched for its first wrong byte."""

from __future__ import annotations

import dataclasses
import time

import torch

from stackproof.measure import patterns

CHUNK_BYTES = 1 << 30
FREE_FRACTION = 0.9  # of the free memory; the rest stays for the driver, NCCL and the test's own temporary
WALK_PERIOD = 128  # words: 64 walking ones, then 64 walking zeros
TILE_WORDS = 2 << 20  # 16 MiB of random words per chunk
PATTERNS = ("address", "walking", "random")


@dataclasses.dataclass(frozen=True)
class MemoryWrong:
    pattern: str
    chunk: int
    wrong: patterns.WrongBytes  # offset within the chunk
    chunk_bytes: int

    def where(self) -> str:
        return (f"{self.pattern} pattern, chunk {self.chunk} (byte {self.chunk * self.chunk_bytes + self.wrong.offset}"
                " of the memory tested)")


@dataclasses.dataclass(frozen=True)
class MemoryTest:
    tested_bytes: int
    free_bytes: int
    seconds: float
    wrong: list[MemoryWrong]
    allocate_seconds: float = 0.0  # of `seconds`: taking the memory (and giving it back)


def _walking(device: torch.device) -> torch.Tensor:
    ones = torch.tensor([1 << bit if bit < 63 else -(1 << 63) for bit in range(64)], dtype=torch.int64)
    return torch.cat([ones, ~ones]).to(device)


def _expected(name: str, index: int, words: int, device: torch.device, seed: int, walk: torch.Tensor,
              scratch: torch.Tensor) -> torch.Tensor:
    """What chunk `index` must hold under pattern `name`, in the shape _shaped gives it (an expanded view for
    the periodic patterns: nothing materialised)."""
    if name == "address":
        return torch.arange(index * words, (index + 1) * words, dtype=torch.int64, device=device, out=scratch)
    if name == "walking":
        return walk.expand(words // WALK_PERIOD, WALK_PERIOD)
    generator = torch.Generator(device=device).manual_seed(patterns.seed_of(seed, "random", index))
    tile = torch.randint(-(1 << 62), 1 << 62, (TILE_WORDS,), dtype=torch.int64, device=device, generator=generator)
    return tile.expand(words // TILE_WORDS, TILE_WORDS)


def _write(chunk: torch.Tensor, name: str, index: int, words: int, device: torch.device, seed: int,
           walk: torch.Tensor, scratch: torch.Tensor) -> None:
    if name == "address":  # straight into the chunk: one pass
        torch.arange(index * words, (index + 1) * words, dtype=torch.int64, device=device, out=chunk.view(torch.int64))
    else:
        _shaped(chunk, name).copy_(_expected(name, index, words, device, seed, walk, scratch))


def _shaped(chunk: torch.Tensor, name: str) -> torch.Tensor:
    words = chunk.view(torch.int64)
    if name == "walking":
        return words.view(-1, WALK_PERIOD)
    if name == "random":
        return words.view(-1, TILE_WORDS)
    return words


def run(device: torch.device, seed: int, chunk_bytes: int = CHUNK_BYTES, most_bytes: int | None = None,
        fraction: float = FREE_FRACTION) -> MemoryTest:
    """Write and verify every pattern over `fraction` of the free memory (at most `most_bytes`), in chunks of
    `chunk_bytes`. The memory goes back to the driver afterwards (NCCL allocates outside torch's cache)."""
    if chunk_bytes % (TILE_WORDS * 8):
        raise ValueError(f"chunks are whole {TILE_WORDS * 8} B tiles, got {chunk_bytes} B")
    started = time.perf_counter()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else (most_bytes or chunk_bytes)
    budget = int(free * fraction) - chunk_bytes  # one chunk's room for the address pattern's scratch
    if most_bytes is not None:
        budget = min(budget, most_bytes)
    words = chunk_bytes // 8
    chunks: list[torch.Tensor] = []
    wrong: list[MemoryWrong] = []
    try:
        scratch = torch.empty(words, dtype=torch.int64, device=device)
        chunks = _take(device, budget // chunk_bytes, chunk_bytes)
        taken = time.perf_counter()
        wrong = _patterns(chunks, words, device, seed, scratch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tested, tested_at = len(chunks) * chunk_bytes, time.perf_counter()
    finally:
        chunks.clear()
        scratch = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    done = time.perf_counter()
    return MemoryTest(tested, free, done - started, wrong, (taken - started) + (done - tested_at))


def _patterns(chunks: list[torch.Tensor], words: int, device: torch.device, seed: int, scratch: torch.Tensor
              ) -> list[MemoryWrong]:
    """Every pattern written over every chunk, then read back. (A function of its own: no loop variable outlives
    it holding a chunk, so the memory goes back to the driver when the caller lets go of the chunks.)"""
    wrong = []
    walk = _walking(device)
    for name in PATTERNS:
        for index, chunk in enumerate(chunks):
            _write(chunk, name, index, words, device, seed, walk, scratch)
        for index, chunk in enumerate(chunks):
            expected = _expected(name, index, words, device, seed, walk, scratch)
            if not torch.equal(_shaped(chunk, name), expected):
                full = expected.reshape(-1).contiguous()
                wrong.append(MemoryWrong(name, index, patterns.first_difference(chunk, full), len(chunk)))
    return wrong


def _take(device: torch.device, count: int, chunk_bytes: int) -> list[torch.Tensor]:
    """`count` chunks: views of one allocation when the allocator has it in one piece (one cudaMalloc, one
    cudaFree), else separate chunks, as many as it gives (the rest is someone else's or fragmented)."""
    if count <= 0:
        return []
    try:
        return list(torch.empty(count * chunk_bytes, dtype=torch.uint8, device=device).view(count, chunk_bytes))
    except torch.OutOfMemoryError:
        pass
    chunks = []
    for _ in range(count):
        try:
            chunks.append(torch.empty(chunk_bytes, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            break
    return chunks
