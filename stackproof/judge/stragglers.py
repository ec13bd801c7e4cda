"""Which rank holds the others up, judged: a rank is late when its own work took more than a tolerance longer
than the others' (the median of every other rank's time). Not the median of all ranks: with 2 ranks that median
is the mean of both, and the 10 % tolerance would need a gap of about 22 % between them; on any world, a rank
judged against a median that includes it is judged partly against itself."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def late_ranks(seconds: Sequence[float | None], tolerance: float, shares: Sequence[int] | None = None) -> dict:
    """Ranks whose time is more than `tolerance` above the median of the other ranks' times. A rank without a
    time (its own measurement failed, which it says itself) is neither judged nor a reference. `shares`: per
    rank, the ranks that ran their work on its GPU at once (emulated nodes, judge/sharing.py): its time is
    divided by that, the time its GPU would take for it alone. Returns {"median": of every time (for the
    record), "slow": [{"rank", "found", "reference", "ratio"}]}."""
    shares = shares or [1] * len(seconds)
    known = {rank: s / max(1, shares[rank]) for rank, s in enumerate(seconds) if s is not None}
    if not known:
        return {"median": None, "slow": []}
    slow = []
    for rank, mine in known.items():
        others = [s for other, s in known.items() if other != rank]
        if not others:
            continue
        reference = statistics.median(others)
        if reference > 0 and mine > reference * (1 + tolerance):
            slow.append({"rank": rank, "found": mine, "reference": reference, "ratio": mine / reference})
    return {"median": statistics.median(known.values()), "slow": slow}
