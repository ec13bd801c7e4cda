"""The fleet circuit breaker: before draining, count the nodes stackproof has already taken out of service (its
reason prefix in `sinfo -R`, its taint on Kubernetes) in the node's pool, and drain no more than --max-drained
of it. Per-node health checks each see one node; only the scheduler sees the fleet, so it is asked."""

from __future__ import annotations

import dataclasses
import math
import re

from stackproof.act.decide import Decision

_LIMIT = re.compile(r"^(\d+(?:\.\d+)?)(%?)$")


@dataclasses.dataclass(frozen=True)
class Fleet:
    pool: frozenset[str]  # the nodes the limit is a share of (the partitions / GPU node pool of the targets)
    drained: frozenset[str]  # of those, the ones stackproof has already drained or tainted


def parse_limit(text: str) -> tuple[float, bool]:
    """'2' -> (2, False); '10%' -> (10.0, True). ValueError for anything else."""
    match = _LIMIT.match(str(text).strip())
    if not match or (not match.group(2) and "." in match.group(1)) or (match.group(2) and float(match.group(1)) > 100):
        raise ValueError(f"expected a node count such as 2 or a share of the pool such as 10%, found {text!r}")
    return float(match.group(1)), bool(match.group(2))


def limit_problem(text: str) -> str | None:
    try:
        parse_limit(text)
    except ValueError as err:
        return str(err)
    return None


def limit(text: str, pool_size: int) -> int:
    """How many of `pool_size` nodes may be out of service at once: a count, or a share rounded up (10% of 2 is
    1, so a small pool can still drain its one bad node)."""
    value, share = parse_limit(text)
    return math.ceil(value * pool_size / 100) if share else int(value)


def hold(decision: Decision, fleet: Fleet, max_drained: str) -> Decision:
    """The decision, with every new drain withheld when it would take the pool past max_drained."""
    new = [a.node for a in decision.drains if a.node not in fleet.drained]
    cap = limit(max_drained, len(fleet.pool))
    if not new or len(fleet.drained) + len(new) <= cap:
        return decision
    already = f" ({', '.join(sorted(fleet.drained))})" if fleet.drained else ""
    return decision.hold_drains(f"{len(fleet.drained)} of {len(fleet.pool)} nodes already out of service by "
                                f"stackproof{already}; draining {', '.join(new)} would pass --max-drained "
                                f"{max_drained} ({cap} node(s)): a failure that wide is more likely the image, the "
                                "settings or the site; fix: look at the drained nodes, resume those repaired",
                                set(new))
