"""Slurm: drain a failed node with scontrol, the reason readable in `sinfo -R`. A drained node finishes its
running jobs and takes no new ones; it comes back by its re-proof (act/resume.py), a lemon by a person."""

from __future__ import annotations

from stackproof.act.breaker import Fleet
from stackproof.act.decide import PREFIX, NodeAction

FIX = ("run as root or SlurmUser (HealthCheckProgram and Prolog do), on a host whose slurm.conf reaches "
       "slurmctld, with the node's Slurm name (--node)")
# One line per node and partition: name, partition, when its reason was set (slurmctld's clock; 'Unknown' when
# none), reason ('none' when it has none). The reason last: it is free text.
FLEET = ["sinfo", "--Node", "--noheader", "--format=%N|%P|%H|%E"]


def commands(action: NodeAction) -> list[list[str]]:
    """A node to drain is drained; any other is left as it is (a drained node comes back by a person)."""
    if not action.drain:
        return []
    return [["scontrol", "update", f"nodename={action.node}", "state=drain", f"reason={action.reason}"]]


def resume(node: str) -> list[str]:
    """Undo this run's own drain (the re-count found the cap passed): the node goes back to service."""
    return ["scontrol", "update", f"nodename={node}", "state=resume"]


def fleet(sinfo: str, targets: set[str]) -> Fleet:
    """FLEET's output -> the nodes of the targets' partitions, which of them stackproof drained, and when."""
    partitions: dict[str, set[str]] = {}
    drained, since = set(), {}
    for line in sinfo.splitlines():
        parts = line.split("|", 3)
        if len(parts) < 4:
            continue
        node, partition, stamp, reason = (p.strip() for p in parts)
        partitions.setdefault(node, set()).add(partition.rstrip("*"))
        if reason.startswith(PREFIX):
            drained.add(node)
            since[node] = stamp
    wanted = set().union(*(partitions.get(t, set()) for t in targets)) if targets else set()
    pool = {n for n, parts in partitions.items() if parts & wanted} or set(partitions)
    return Fleet(frozenset(pool), frozenset(drained & pool), {n: t for n, t in since.items() if n in pool})
