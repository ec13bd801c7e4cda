"""Who a rank is, in the words a platform team acts on: the scheduler's node name, the host, and the GPU
(index, UUID, serial, PCI bus id, from NVML)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from typing import Any

# The scheduler's name for the node is what a drain or a taint needs: Slurm sets SLURMD_NODENAME in every task;
# on Kubernetes the manifests hand the pod its node through the downward API as STACKPROOF_NODE_NAME.
NODE_NAME_ENV = ("STACKPROOF_NODE_NAME", "SLURMD_NODENAME")


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    rank: int
    node: str
    host: str
    node_rank: int
    local_rank: int
    gpu: dict[str, Any] | None = None  # index, name, uuid, serial, pci_bus_id; None on CPU
    problem: str = ""  # what could not be read (an NVML error), said instead of guessed

    def where(self) -> str:
        """'rank 3 on gpu-017 (GPU 3, GPU-8c1e..., serial 1654..., PCI 0000:19:00.0)'."""
        text = f"rank {self.rank} on {self.node}"
        if self.gpu:
            details = [f"GPU {self.gpu['index']}"] + [f"{label} {self.gpu[key]}" for key, label in
                                                      (("uuid", ""), ("serial", "serial"), ("pci_bus_id", "PCI"))
                                                      if self.gpu.get(key)]
            text += f" ({', '.join(d.strip() for d in details)})"
        return text


def node_name(env: Mapping[str, str]) -> str:
    """The scheduler's name for this node in `env` (the environment its entry point read), else the host name."""
    return next((env[name] for name in NODE_NAME_ENV if env.get(name)), socket.gethostname())


def of_this_rank(rank: int, node_rank: int, local_rank: int, device_index: int | None, node: str) -> RankIdentity:
    """`node`: the node's name as the run resolved it (--node-name, else node_name()'s)."""
    gpu, problem = None, ""
    if device_index is not None:
        gpu, problem = _gpu(device_index)
    return RankIdentity(rank, node, socket.gethostname(), node_rank, local_rank, gpu, problem)


def _gpu(device_index: int) -> tuple[dict[str, Any] | None, str]:
    from stackproof.measure import topology

    try:
        gpus = topology.visible(topology.inventory(), topology.cuda_visible_devices())
    except topology.NvmlUnavailable as err:
        return {"index": device_index}, f"GPU identity unknown: {err}"
    if device_index >= len(gpus):
        return {"index": device_index}, f"NVML shows {len(gpus)} visible GPU(s), this rank uses cuda:{device_index}"
    gpu = gpus[device_index]
    return {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "serial": gpu.serial,
            "pci_bus_id": gpu.pci_bus_id}, ""


def from_json(data: dict[str, Any]) -> RankIdentity:
    return RankIdentity(**data)
