"""Where a run's time goes, from sampled stacks (benchmarks/startup.py --sample DIR): for each run kept under DIR,
the rank's main thread between the phases report.json recorded, the functions it was in (inclusive, ms), and the
launcher's likewise. Figures for finding what to cut; the phases themselves are startup.py's.

    python benchmarks/sampled.py DIR [--top 12] [--match stackproof/,smoke_tests/]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stackproof.run.phases import RANK_PHASES, RUN_PHASES


def load(path: Path) -> tuple[dict, list[tuple[float, list[str]]]]:
    head, samples = {}, []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except ValueError:  # the last line of a process that left mid-write
            continue
        if "t" in item:
            samples.append((item["t"], item["s"]))
        elif not head:
            head = item
    return head, samples


def is_rank(samples: list[tuple[float, list[str]]]) -> bool:
    return any(any("stackproof/run/worker.py:_run" in f for f in stack) for _, stack in samples)


def spacing(samples) -> float:
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(samples))
    return gaps[len(gaps) // 2] if gaps else 0.0


def window(samples, begin: float, end: float, top: int, match: tuple[str, ...], interval: float) -> list[str]:
    inside = [stack for t, stack in samples if begin <= t < end]
    if not inside:
        return []
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for stack in inside:
        names = [f.rpartition(":")[0] for f in stack]
        inclusive.update(set(n for n in names if n.startswith(match)))
        leaf[stack[-1]] += 1
    rows = [f"      {n * interval * 1e3:7.0f} ms  {name}" for name, n in inclusive.most_common(top)]
    rows += [f"      {n * interval * 1e3:7.0f} ms  leaf {name}" for name, n in leaf.most_common(max(3, top // 3))]
    return rows


def timeline(processes, origin: float, end: float, step: float = 0.1) -> list[str]:
    """Every process sampled in the run, step by step: where its main thread was most (the deepest frame of
    stackproof or of the suite, else the innermost)."""
    lines = []
    for head, samples in processes:
        inside = [(t, s) for t, s in samples if origin - 1 <= t <= end + 1]
        if not inside:
            continue
        lines.append(f"  process {head.get('pid')} {' '.join(head.get('argv', [])[:3])}: sampled "
                     f"{inside[0][0] - origin:.2f} .. {inside[-1][0] - origin:.2f} s")
        buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for t, stack in inside:
            ours = [f for f in stack if "stackproof/" in f or "smoke_tests/" in f]
            where = (ours[-1] if ours else stack[-1]).rpartition("stackproof/")[2]
            buckets[int((t - origin) // step)][where] += 1
        for bucket in sorted(buckets):
            most = ", ".join(f"{where} x{n}" for where, n in buckets[bucket].most_common(2))
            lines.append(f"    {bucket * step:6.1f} {most}")
    return lines


def report_for(run: Path, top: int, match: tuple[str, ...], with_timeline: bool = False) -> str:
    try:
        report = json.loads(next(run.rglob("report.json")).read_text())
    except (StopIteration, OSError, ValueError) as err:
        return f"# {run.name}: no report.json ({err})"
    phases = report.get("context", {}).get("phases", {})
    rank0 = (phases.get("ranks") or [{}])[0]
    marks = [("launcher_started", phases.get("launcher_started")),
             *((name, rank0.get(name)) for name in RANK_PHASES),
             *((name, phases.get(name)) for name in RUN_PHASES)]
    marks = [(n, t) for n, t in marks if t]
    marks.sort(key=lambda m: m[1])
    processes = [load(p) for p in sorted((run / "samples").glob("*.jsonl"))]
    origin, finish = marks[0][1], marks[-1][1]
    ranks = [p for p in processes if is_rank(p[1]) and any(origin <= t <= finish for t, _ in p[1])]
    lines = [f"# {run.name}: " + ", ".join(f"{n} {t - origin:.2f}" for n, t in marks)]
    for head, samples in ranks[:1]:
        interval = spacing(samples)
        lines.append(f"  rank process {head.get('pid')} ({len(samples)} samples, one per {interval * 1e3:.1f} ms)")
        for (first, begin), (then, end) in itertools.pairwise(marks):
            lines.append(f"    {first} -> {then}: {end - begin:.2f} s")
            lines += window(samples, begin, end, top, match, interval)
        checks = sorted((c for c in report.get("checks", []) if c.get("duration_s")), key=lambda c: -c["duration_s"])
        own = sum(c["duration_s"] for c in checks)
        start, done = phases.get("checks_started"), phases.get("checks_done")
        if start and done:
            between = [(t, s) for t, s in samples if start <= t < done
                       and not any("smoke_tests/" in f for f in s)]
            lines.append(f"    checks: {done - start:.2f} s, their own {own:.2f} s; samples outside any check's "
                         f"code: {len(between)}")
            lines += window(between, start, done, top, match, interval)
    if with_timeline:
        lines += timeline(processes, origin, finish)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--match", default="stackproof/,smoke_tests/,torch/,_pytest/,pluggy/,importlib",
                        help="comma-separated prefixes of the functions counted inclusively")
    parser.add_argument("--timeline", action="store_true", help="also every process, 0.1 s at a time")
    options = parser.parse_args(argv)
    # A run keeps its report.json beside its samples; the agent's own folder (its ranks' samples, shared) has none.
    runs = sorted(p for p in options.folder.iterdir() if (p / "samples").is_dir() and (p / "report.json").exists())
    for run in runs:
        print(report_for(run, options.top, tuple(options.match.split(",")), options.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
