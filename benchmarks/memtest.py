"""Where the memory test's time goes on a GPU, pattern by pattern, and what other ways of writing and comparing
the same patterns would cost: seconds and the HBM bytes per second each way reaches (reads + writes counted), over
the same chunks. Figures for choosing how stackproof/measure/memtest.py writes and compares, not a test.

    python benchmarks/memtest.py [--gib 32] [--repeat 3]

Ways, per pattern (one chunk = memtest.CHUNK_BYTES):
  current     what memtest.py does now (periodic patterns written and compared as expanded views)
  nosync      the same kernels, every comparison's verdict kept on the GPU and read once at the end
  contiguous  the expected chunk materialised in the scratch buffer, then a contiguous copy and comparison
And memtest.run itself over the same amount, for the whole test's seconds; then the host<->device copies
(gpu_proof.HostCopies, the fast tier's) alone and beside a memory test run on a stream and a thread of its own:
whether running the two together would change the copies' figures, and what it would save.

Measured on 1 x H200 (torch 2.11, 2026-12-04): per 8 GiB, address 0.025 s, walking 0.006 s, random 0.008 s the
current way (the address pattern, compared against a materialised copy, is two thirds of the test); keeping the
verdicts on the GPU saves nothing, and the contiguous way takes twice as long for the periodic patterns. The
copies (55.5 / 55.4 GB/s) keep their figures beside a memory test, but the memory test then takes 1.12-1.14 s
instead of 0.70-0.76 s, so the two together end no sooner (1.12-1.14 s) than one after the other (1.11-1.22 s):
they share the driver (the pinned allocation) and the memory. The fast tier runs them one after the other.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stackproof.measure import gpu_proof, memtest, patterns

GiB = 1 << 30
WORD = 8


def _expected_into(name: str, index: int, words: int, device, seed: int, walk, scratch) -> torch.Tensor:
    """The expected chunk, materialised contiguous in `scratch`."""
    if name == "address":
        return torch.arange(index * words, (index + 1) * words, dtype=torch.int64, device=device, out=scratch)
    periodic = memtest._expected(name, index, words, device, seed, walk, scratch)
    scratch.view(periodic.shape).copy_(periodic)
    return scratch


def way_current(name, chunks, words, device, seed, walk, scratch) -> int:
    for index, chunk in enumerate(chunks):
        memtest._write(chunk, name, index, words, device, seed, walk, scratch)
    bad = 0
    for index, chunk in enumerate(chunks):
        expected = memtest._expected(name, index, words, device, seed, walk, scratch)
        bad += not torch.equal(memtest._shaped(chunk, name), expected)
    return bad


def way_nosync(name, chunks, words, device, seed, walk, scratch) -> int:
    for index, chunk in enumerate(chunks):
        memtest._write(chunk, name, index, words, device, seed, walk, scratch)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for index, chunk in enumerate(chunks):
        expected = memtest._expected(name, index, words, device, seed, walk, scratch)
        bad += (memtest._shaped(chunk, name) != expected).any()
    return int(bad)


def way_contiguous(name, chunks, words, device, seed, walk, scratch) -> int:
    for index, chunk in enumerate(chunks):
        if name == "address":
            memtest._write(chunk, name, index, words, device, seed, walk, scratch)
        else:
            chunk.view(torch.int64).copy_(_expected_into(name, index, words, device, seed, walk, scratch))
    bad = 0
    for index, chunk in enumerate(chunks):
        expected = _expected_into(name, index, words, device, seed, walk, scratch)
        bad += not torch.equal(chunk.view(torch.int64), expected)
    return bad


# HBM bytes each way moves per chunk, in chunks' worth (write + compare), for the bandwidth column.
PASSES = {
    ("current", "address"): 1 + 3, ("current", "walking"): 1 + 1, ("current", "random"): 1 + 1,
    ("nosync", "address"): 1 + 3, ("nosync", "walking"): 1 + 1, ("nosync", "random"): 1 + 1,
    ("contiguous", "address"): 1 + 3, ("contiguous", "walking"): 3 + 3, ("contiguous", "random"): 3 + 3,
}
WAYS = {"current": way_current, "nosync": way_nosync, "contiguous": way_contiguous}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=32, help="GiB of chunks to test each way (default 32)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/memtest.py: no GPU: nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    words = memtest.CHUNK_BYTES // WORD
    seed = patterns.seed_of("memtest-benchmark")
    chunks = list(torch.empty(args.gib * GiB, dtype=torch.uint8, device=device).view(-1, memtest.CHUNK_BYTES))
    scratch = torch.empty(words, dtype=torch.int64, device=device)
    walk = memtest._walking(device)
    print(f"# {torch.cuda.get_device_name(device)}: {len(chunks)} chunks of {memtest.CHUNK_BYTES >> 20} MiB; "
          f"median of {args.repeat}")
    print(f"# {'way':<11} {'pattern':<8} {'seconds':>8} {'GB/s':>8} {'wrong':>6}")
    for way, run in WAYS.items():
        for name in memtest.PATTERNS:
            times, wrong = [], 0
            for _ in range(args.repeat):
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                wrong = run(name, chunks, words, device, seed, walk, scratch)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            moved = PASSES[(way, name)] * len(chunks) * memtest.CHUNK_BYTES
            print(f"  {way:<11} {name:<8} {seconds:8.3f} {moved / seconds / 1e9:8.0f} {wrong:>6}")
    del chunks, scratch
    torch.cuda.empty_cache()
    times = []
    for _ in range(args.repeat):
        tested = memtest.run(device, seed, most_bytes=args.gib * GiB)
        times.append(tested.seconds)
    print(f"# memtest.run over {tested.tested_bytes / GiB:.0f} GiB: {statistics.median(times):.3f} s "
          f"(allocation {tested.allocate_seconds:.3f} s), {len(tested.wrong)} wrong")
    _beside_copies(device, seed, args.repeat)
    return 0


def _copies(copies: gpu_proof.HostCopies) -> tuple[float, float]:
    copies.prepare()  # the host buffer carries the pattern again: the last device-to-host copy overwrote it
    h2d, _, wrong = copies.to_device()
    d2h = copies.to_host()
    assert wrong is None and copies.check_host() is None, "a copy delivered wrong bytes"
    return h2d / 1e9, d2h / 1e9


def _beside_copies(device: torch.device, seed: int, repeat: int) -> None:
    """The copies alone, the memory test alone (whole free memory, as the fast tier), then both at once."""
    started = time.perf_counter()
    copies = gpu_proof.HostCopies(device, seed)
    print(f"# host<->device copies of {copies.nbytes >> 20} MiB: pinned buffer made in "
          f"{time.perf_counter() - started:.3f} s")
    side = torch.cuda.Stream(device)

    def on_side() -> memtest.MemoryTest:
        with torch.cuda.stream(side):
            return memtest.run(device, seed)

    print(f"# {'run':<22} {'h2d GB/s':>9} {'d2h GB/s':>9} {'memtest s':>10} {'wall s':>7}")
    for turn in range(repeat):
        started = time.perf_counter()
        h2d, d2h = _copies(copies)
        copies_s = time.perf_counter() - started
        started = time.perf_counter()
        alone = memtest.run(device, seed)
        print(f"  {'apart ' + str(turn + 1):<22} {h2d:9.1f} {d2h:9.1f} {alone.seconds:10.3f} "
              f"{copies_s + time.perf_counter() - started:7.3f}")
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(on_side)
            h2d, d2h = _copies(copies)
            beside = pending.result()
        print(f"  {'together ' + str(turn + 1):<22} {h2d:9.1f} {d2h:9.1f} {beside.seconds:10.3f} "
              f"{time.perf_counter() - started:7.3f}")


if __name__ == "__main__":
    sys.exit(main())
