"""The fleet circuit breaker: before draining, count the nodes stackproof has already taken out of service (its
reason prefix in `sinfo -R`, its taint on Kubernetes) in the node's pool, and drain no more than --max-drained
of it. Per-node health checks each see one node; only the scheduler sees the fleet, so it is asked.

Many nodes act at once (a job's Prologs, a DaemonSet rollout, one bad driver everywhere): a count each node
takes before the others drain would let them all through. So the count and the drain are serialized:
  - Slurm: a lock on shared storage (--breaker-lock FILE, flock with a timeout, act/lock.py), and always a
    re-count after draining in the order slurmctld stamped the drains (`keeps`): a node past the cap resumes.
  - Kubernetes: a claim in a ConfigMap, replaced with compare-and-swap on its resourceVersion (`claim`, the
    pure half of act/kubernetes.py's claim_commands)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

from stackproof.act.decide import Decision

_LIMIT = re.compile(r"^(\d+(?:\.\d+)?)(%?)$")


@dataclasses.dataclass(frozen=True)
class Fleet:
    pool: frozenset[str]  # the nodes the limit is a share of (the partitions / GPU node pool of the targets)
    drained: frozenset[str]  # of those, the ones stackproof has already drained or tainted
    # node -> when the scheduler recorded its drain (Slurm: the reason's time, slurmctld's clock), for `keeps`
    since: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)


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


def keeps(fleet: Fleet, node: str, max_drained: str) -> bool:
    """The re-count after `node` drained itself: does it keep its drain? The drains in the order the scheduler
    stamped them (then by name): the first cap keep theirs, any later one resumes. A node that re-counts once
    its own stamp's second is over sees every drain stamped before or with it, so all nodes agree on the order."""
    cap = limit(max_drained, len(fleet.pool))
    order = sorted(fleet.drained, key=lambda n: (fleet.since.get(n, ""), n))
    return node in order[:cap]


# --- Kubernetes: the claim in a ConfigMap (compare-and-swap on resourceVersion) ------------------------------
CLAIMS_KEY = "claims"  # the ConfigMap's data key: JSON {node: ISO time of the claim}
# A claim whose taint has not appeared after this long is dropped (its node's kubectl taint failed or it died).
CLAIM_TTL_S = 600


@dataclasses.dataclass(frozen=True)
class Claim:
    granted: bool
    words: str
    data: dict[str, str] | None = None  # the ConfigMap's new data, to write with the resourceVersion read


def claim(claims_json: str, fleet: Fleet, node: str, max_drained: str, now: float) -> Claim:
    """Whether `node` may taint itself, from the ConfigMap's claims and the live taints: the claimed nodes are
    the tainted ones plus claims younger than CLAIM_TTL_S (a node between its claim and its taint); granted
    when those with `node` stay within the cap. Granted: the new claims, to be written only if the ConfigMap
    is still at the version read (else read again: another node claimed in between)."""
    import datetime

    try:
        old = json.loads(claims_json or "{}")
        assert isinstance(old, dict)
    except (ValueError, AssertionError):
        old = {}  # a damaged ConfigMap: the taints alone still count

    def age(stamp: object) -> float:
        try:
            return now - datetime.datetime.fromisoformat(str(stamp)).timestamp()
        except ValueError:
            return float("inf")

    live = {n: t for n, t in old.items() if n in fleet.drained or age(t) < CLAIM_TTL_S}
    claimed = set(live) | set(fleet.drained)
    cap = limit(max_drained, len(fleet.pool))
    if node in claimed:
        return Claim(True, f"{node} already claimed", None)
    if len(claimed) + 1 > cap:
        return Claim(False, f"{len(claimed)} of {len(fleet.pool)} nodes tainted or claimed by stackproof "
                            f"({', '.join(sorted(claimed))}); tainting {node} would pass --max-drained {max_drained} "
                            f"({cap} node(s)): a failure that wide is more likely the image, the settings or the "
                            "site; fix: look at the tainted nodes, untaint those repaired")
    stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds")
    return Claim(True, f"claimed {len(claimed) + 1} of {cap}", {CLAIMS_KEY: json.dumps({**live, node: stamp},
                                                                                       sort_keys=True)})
