"""Decisions rank 0 takes over every rank's value (the `decide` of DistEnv.agree). Pure functions of the values
in rank order, so they are unit-tested without a world."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

OUTCOME_ORDER = ("passed", "skipped", "failed")


def majority(values: Sequence[Hashable], trusted: Sequence[bool] | None = None) -> Hashable | None:
    """The value more trusted positions share than any other; None on a tie (no value can be trusted).
    Every position votes when `trusted` is None or trusts none."""
    voters = [v for v, ok in zip(values, trusted or [True] * len(values), strict=True) if ok] or list(values)
    ranked = Counter(voters).most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


def odd_ones_out(values: Sequence[Hashable], trusted: Sequence[bool] | None = None,
                 tie_goes_to_rank_0: bool = True) -> list[int]:
    """Ranks whose value differs from the majority's. On a tie the reference is the value of the lowest rank among
    the most common ones (with two ranks, rank 0's: DDP broadcasts rank 0's state, so it is the reference by
    construction), or, with tie_goes_to_rank_0=False, every rank stands out (1 against 1: nobody can be trusted)."""
    reference = majority(values, trusted)
    if reference is None and tie_goes_to_rank_0 and values:
        counts = Counter(values)
        reference = next(v for v in values if counts[v] == max(counts.values()))
    return [rank for rank, value in enumerate(values) if reference is None or value != reference]


def joint_outcome(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One check's outcome over every rank ({"outcome", "message"} each): failed if any rank failed, naming the
    ranks (those that failed the same way together); a skip must be unanimous."""
    world = len(reports)
    failed: dict[str, list[int]] = {}
    for rank, report in enumerate(reports):
        if report["outcome"] == "failed":
            failed.setdefault(report["message"], []).append(rank)
    skipped = [rank for rank, report in enumerate(reports) if report["outcome"] == "skipped"]
    if failed:
        ranks = sorted(r for group in failed.values() for r in group)
        groups = " | ".join(f"rank(s) {_ranks(group)}: {message}" if len(failed) > 1 else message
                            for message, group in failed.items())
        return {"outcome": "failed", "ranks": ranks,
                "message": f"failed on rank(s) {_ranks(ranks)} of {world}: {groups}"}
    if skipped and len(skipped) != world:
        return {"outcome": "failed", "ranks": sorted(set(range(world)) - set(skipped)),
                "message": f"ranks disagree: skipped on {_ranks(skipped)}, ran on the others; the suite's skip "
                           "decisions must be the same on every rank"}
    return {"outcome": reports[0]["outcome"] if reports else "passed", "ranks": [],
            "message": reports[0]["message"] if reports else ""}


def _ranks(ranks: Sequence[int], shown: int = 16) -> str:
    """[1, 2, 3] as written, but a fleet's long list is cut: [0, 1, ..., +1006 more]."""
    ranks = list(ranks)
    if len(ranks) <= shown:
        return str(ranks)
    return "[" + ", ".join(map(str, ranks[:shown])) + f", ... +{len(ranks) - shown} more]"
