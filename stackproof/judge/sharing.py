"""Ranks that share one GPU (the same UUID on two ranks). On a real node that is a launcher's or a scheduler's
mistake (more ranks than GPUs, every rank on cuda:0): a configuration finding, named as such instead of showing
as a slow GPU and a straggler. In the emulation of several nodes on one machine (--emulated-nodes,
docs/launchers.md) it is by design: there a GPU's own figures are measured once, by the first rank on it, and the
straggler rule weighs each rank's time by the ranks its GPU runs at once. Pure: every rank's UUID in, answers out.
"""

from __future__ import annotations

from collections.abc import Sequence

from stackproof.judge.findings import Finding

CHECK = "gpus one rank per GPU"
FIX = ("start one rank per GPU: torchrun --nproc-per-node = the node's GPUs, each rank on cuda:LOCAL_RANK; check "
       "CUDA_VISIBLE_DEVICES and the scheduler's GPU binding (srun --gpus-per-task=1 / --gpu-bind, the device "
       "plugin's nvidia.com/gpu count); to emulate nodes on one machine on purpose, pass --emulated-nodes")


def holders(uuids: Sequence[str | None]) -> dict[str, list[int]]:
    """{UUID: the ranks on it} for every GPU two or more ranks hold (a rank without a UUID holds none)."""
    ranks: dict[str, list[int]] = {}
    for rank, uuid in enumerate(uuids):
        if uuid:
            ranks.setdefault(uuid, []).append(rank)
    return {uuid: held for uuid, held in ranks.items() if len(held) > 1}


def shares(uuids: Sequence[str | None]) -> list[int]:
    """Per rank, how many ranks run on its GPU (1 for a GPU of its own, or no UUID)."""
    shared = holders(uuids)
    return [len(shared.get(uuid or "", [rank])) for rank, uuid in enumerate(uuids)]


def measured_by(uuids: Sequence[str | None], rank: int) -> int:
    """The rank that measures this rank's GPU: the first rank on it (itself, on a GPU of its own)."""
    return holders(uuids).get(uuids[rank] or "", [rank])[0]


def findings(uuids: Sequence[str | None], nodes: Sequence[str], rank: int, gpu_index: int | None,
             emulated: bool) -> list[Finding]:
    """This rank's finding when its GPU is shared with other ranks, unless the nodes are emulated."""
    held = holders(uuids).get(uuids[rank] or "")
    if not held or emulated:
        return []
    where = ", ".join(f"rank {r} on {nodes[r]}" for r in held)
    return [Finding(gpu_index, uuids[rank] or "", CHECK, "one rank per GPU", f"{len(held)} ranks on it ({where})",
                    "configuration", "triage", FIX)]
