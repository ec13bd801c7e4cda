"""Which rank holds the others up, judged: a rank is late when its own work took more than a tolerance longer
than the others' (the median of every other rank's time). Not the median of all ranks: with 2 ranks that median
is the mean of both, and the 10 % tolerance would need a gap of about 22 % between them; on any world, a rank
judged against a median that includes it is judged partly against itself."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from stackproof.judge import sharing
from stackproof.judge.findings import Finding

LATE_FIX = ("a rank slower than its peers holds every collective up: look for a competing process (nvidia-smi), "
            "thermal or power throttling (clock_event_reasons), a CPU-bound data loader")


def late_ranks(seconds: Sequence[float | None], tolerance: float, gpus: Sequence[str | None] | None = None) -> dict:
    """Ranks whose time is more than `tolerance` above the median of the other ranks' times. A rank without a
    time (its own measurement failed, which it says itself) is neither judged nor a reference. `gpus`: each
    rank's GPU (UUID; None for none). Ranks that share a GPU (emulated nodes, judge/sharing.py) ran their work on
    it at once: each one's time is divided by how many share it (the time its GPU would take for it alone), and
    they are never each other's reference, since the GPU's time-slicing, not either rank, decides which of them
    finishes first (measured on one H200, two emulated nodes: 6.1 against 5.4 ms, 1.6 against 1.2 ms). A rank
    with no reference of another GPU is not judged. Returns {"median": of every time (for the record), "slow":
    [{"rank", "found", "reference", "ratio"}], "judged": the ranks that had a reference}."""
    gpus = list(gpus) if gpus is not None else [None] * len(seconds)
    shares = sharing.shares(gpus)
    known = {rank: s / max(1, shares[rank]) for rank, s in enumerate(seconds) if s is not None}
    if not known:
        return {"median": None, "slow": [], "judged": []}
    slow, judged = [], []
    for rank, mine in known.items():
        others = [s for other, s in known.items() if other != rank and not (gpus[rank] and gpus[other] == gpus[rank])]
        if not others:
            continue
        judged.append(rank)
        reference = statistics.median(others)
        if reference > 0 and mine > reference * (1 + tolerance):
            slow.append({"rank": rank, "found": mine, "reference": reference, "ratio": mine / reference})
    return {"median": statistics.median(known.values()), "slow": slow, "judged": judged}


def late(phase: str, slow: dict, tolerance: float, gpu_index: int | None) -> Finding:
    """A rank late_ranks found slow (its "found", "reference" and "ratio"), as a finding on its GPU (or rank)."""
    return Finding(gpu_index, "", f"straggler in {phase}", f"this rank's own work before the collective at most "
                   f"+{tolerance:.0%} above the other ranks' median {slow['reference'] * 1e3:.1f} ms "
                   "(--straggler-tolerance)", f"{slow['found'] * 1e3:.1f} ms, {(slow['ratio'] - 1) * 100:.0f}% "
                   "above it", "performance", "triage", LATE_FIX)
