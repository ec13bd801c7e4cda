"""Decisions rank 0 takes over every rank's value (the `decide` of DistEnv.agree). Pure functions of the values
in rank order, so they are unit-tested without a world."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

OUTCOME_ORDER = ("passed", "skipped", "failed")


def odd_ones_out(values: Sequence[Hashable]) -> list[int]:
    """Ranks whose value differs from the majority's. A tie goes to the value of the lowest rank among the
    most common ones (with two ranks, rank 0 is the reference)."""
    if not values:
        return []
    counts = Counter(values)
    top = max(counts.values())
    reference = next(v for v in values if counts[v] == top)
    return [rank for rank, value in enumerate(values) if value != reference]


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
