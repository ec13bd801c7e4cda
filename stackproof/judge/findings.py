"""A finding: one thing judged wrong about a node, named the way a fleet tool acts on it (NVIDIA DCGM's and
LBNL/Azure NHC's vocabulary): what was expected, what was found, which GPU, a category, a severity and the fix.

Categories say whose fault it is, and so what may be done about it (stackproof/act's policy table):
  gpu-hardware   the GPU itself (ECC, XID, retired pages, a GPU lost, clocks held back by heat or power)
  interconnect   its links (NVLink down or erroring, PCIe downtrained, a slow pair of GPUs or nodes)
  performance    a figure below what the hardware should reach (HBM, GEMM, bandwidth, a baseline)
  software-pins  the image: versions or libraries other than promised
  configuration  the node's or the operator's setup (a spec mismatch in settings, shared memory, NVML access)
  unclassified   a check's assertion failed, and the check did not say what that means for the machine
  tool-error     stackproof itself, or a probe, failed: an exception that is no check's judgement of the machine
Severities, most severe first: isolate (take the GPU or node out of service), reset (a GPU reset or reboot
clears it), triage (someone must look).

Findings are the one currency from the GPU to the scheduler: each rank hands over its own (its GPU, its node),
the launcher adds what it saw before and after the ranks (a GPU lost at pre-flight, a hang, a rank that died),
and a node's action is the strongest the policy table gives over its findings (stackproof/act/decide.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

CATEGORIES = ("gpu-hardware", "interconnect", "performance", "software-pins", "configuration", "unclassified",
              "tool-error")
SEVERITIES = ("isolate", "reset", "triage")  # most severe first

RESET = "drain the node and reset the GPU (nvidia-smi -r, or reboot); if it comes back after the reset, RMA it"
RMA = "take the GPU out of service (drain the node) and RMA it, quoting its serial number"


def lost_gpu_fix(where: str = "") -> str:
    """What to do about a GPU the node lost (fell off the bus, or the driver did not bind it); `where`: its address."""
    return (f"drain the node; check the kernel log for Xid 79 / NVRM errors{where} and nvidia-smi; reboot; "
            f"if a GPU stays missing, {RMA}")


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
    # Where, stamped by the rank that found it (run/plugin.py) or the launcher: empty/None when not known.
    node: str = ""
    rank: int | None = None
    pci_bus_id: str = ""
    source: str = ""  # the suite's check that found it (e.g. per_gpu::health), or the launcher's step

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES or self.severity not in SEVERITIES:
            raise ValueError(f"category must be one of {CATEGORIES} and severity one of {SEVERITIES}, "
                             f"got {self.category!r}, {self.severity!r}")

    def where(self) -> str:
        """'GPU 3 GPU-8c1e... PCI 0000:19:00.0', 'rank 6' (found by a rank without a GPU of its own), or 'node'."""
        if self.gpu_index is None:
            return f"rank {self.rank}" if self.rank is not None else "node"
        return " ".join(x for x in (f"GPU {self.gpu_index}", self.uuid if self.uuid != "n/a" else "",
                                    f"PCI {self.pci_bus_id}" if self.pci_bus_id else "") if x)

    def __str__(self) -> str:
        return (f"{self.where()}: {self.check}: expected {self.expected}, found {self.found} "
                f"[{self.category}, {self.severity}]; fix: {self.action}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"a finding with unknown fields {sorted(unknown)}")
        return cls(**data)

    def at(self, **where: Any) -> Finding:
        """The same finding with the blanks of where it was found filled in (a rank stamps its own)."""
        blanks = {k: v for k, v in where.items() if getattr(self, k) in ("", None, "n/a") and v not in ("", None)}
        return dataclasses.replace(self, **blanks) if blanks else self


def tool_error(check: str, error: str, fix: str = "") -> Finding:
    """A probe or stackproof itself failed (an exception, a timeout of the tool): said, never drained."""
    return Finding(None, "", check, "the check to run to its judgement", error, "tool-error", "triage",
                   fix or "a stackproof or probe error, not a finding about the machine: see the rank's log in "
                          "the reports folder's logs/, and report it with the log if it recurs")


def worst(findings: list[Finding]) -> tuple[str, str] | None:
    """(category, severity) of the most severe finding; None when there is none."""
    if not findings:
        return None
    first = min(findings, key=lambda f: SEVERITIES.index(f.severity))
    return first.category, first.severity


MESSAGE_FINDINGS = 3  # a failure's message names this many of its findings


def first_of(items: Sequence[str], shown: int, sep: str = "; ") -> str:
    """The first `shown` of `items` joined, and how many more there are: what a message or a finding says of a
    list whose whole is in the record."""
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return sep.join(items[:shown]) + more


@dataclasses.dataclass(frozen=True)
class Judged:
    """A check's answer on this rank: what its judge step found, which the suite's runner hands over (run/plugin.py
    pytest_pyfunc_call): each finding fails the check here and decides what is done to the node. `hint`: the fix
    the report prints when it fails; `where`: what heads the failure's message (the node, the GPU)."""

    findings: Iterable[Finding] = ()
    hint: str = ""
    where: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "findings", tuple(self.findings))  # any iterable in, a tuple kept

    @property
    def message(self) -> str:
        """The first MESSAGE_FINDINGS findings, and how many more (every one is in the record)."""
        said = first_of([str(f) for f in self.findings], MESSAGE_FINDINGS, " | ")
        return f"{self.where}: {said}" if self.where else said
