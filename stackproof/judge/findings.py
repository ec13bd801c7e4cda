"""A finding: one thing judged wrong about a node, named the way a fleet tool acts on it (NVIDIA DCGM's and
LBNL/Azure NHC's vocabulary): what was expected, what was found, which GPU, a category, a severity and the fix.

Categories say whose fault it is, and so what may be done about it (stackproof/act's policy table):
  gpu-hardware   the GPU itself (ECC, XID, retired pages, a GPU lost, clocks held back by heat or power)
  interconnect   its links (NVLink down or erroring, PCIe downtrained, a slow pair of GPUs or nodes)
  performance    a figure below what the hardware should reach (HBM, GEMM, bandwidth, a baseline)
  software-pins  the image: versions or libraries other than promised
  configuration  the node's or the operator's setup (a spec mismatch in settings, shared memory, NVML access)
Severities, most severe first: isolate (take the GPU or node out of service), reset (a GPU reset or reboot
clears it), triage (someone must look).
"""

from __future__ import annotations

import dataclasses

CATEGORIES = ("gpu-hardware", "interconnect", "performance", "software-pins", "configuration")
SEVERITIES = ("isolate", "reset", "triage")  # most severe first

RESET = "drain the node and reset the GPU (nvidia-smi -r, or reboot); if it comes back after the reset, RMA it"
RMA = "take the GPU out of service (drain the node) and RMA it, quoting its serial number"


@dataclasses.dataclass(frozen=True)
class Finding:
    gpu_index: int | None  # None: about the node as a whole
    uuid: str
    check: str
    expected: str
    found: str
    category: str
    severity: str
    action: str  # the fix, in words a person acts on

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES or self.severity not in SEVERITIES:
            raise ValueError(f"category must be one of {CATEGORIES} and severity one of {SEVERITIES}, "
                             f"got {self.category!r}, {self.severity!r}")

    def __str__(self) -> str:
        where = "node" if self.gpu_index is None else f"GPU {self.gpu_index} {self.uuid}"
        return (f"{where}: {self.check}: expected {self.expected}, found {self.found} "
                f"[{self.category}, {self.severity}]; fix: {self.action}")


def worst(findings: list[Finding]) -> tuple[str, str] | None:
    """(category, severity) of the most severe finding; None when there is none."""
    if not findings:
        return None
    first = min(findings, key=lambda f: SEVERITIES.index(f.severity))
    return first.category, first.severity
