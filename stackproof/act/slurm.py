"""Slurm: drain a failed node with scontrol, the reason readable in `sinfo -R`. A drained node finishes its
running jobs and takes no new ones; a person brings it back with `scontrol update nodename=N state=resume`."""

from __future__ import annotations

from stackproof.act.decide import NodeAction

FIX = ("run as root or SlurmUser (HealthCheckProgram and Prolog do), on a host whose slurm.conf reaches "
       "slurmctld, with the node's Slurm name (--node)")


def commands(action: NodeAction) -> list[list[str]]:
    """A failed node is drained; a node that passed is left as it is (a drained node comes back by a person)."""
    if not action.failed:
        return []
    return [["scontrol", "update", f"nodename={action.node}", "state=drain", f"reason={action.reason}"]]
