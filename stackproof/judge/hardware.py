"""Expected vs found for the hardware itself: what each GPU should have (its own NVLinks and PCIe capability,
and what its same-model peers on the node have: links, memory, max clocks) against what it has now. Pure
functions of topology.Gpu facts; the findings name the GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stackproof.judge.bars import nvlinks_expected, pcie_expected
from stackproof.judge.findings import RESET, RMA, Finding, tool_error

if TYPE_CHECKING:
    from stackproof.measure.topology import Gpu

RESEAT = "reseat the GPU / riser and check the slot and its BIOS link settings (lspci -vv: LnkSta vs LnkCap)"
NVLINK_FIX = ("check the fabric (nvidia-smi nvlink -s; fabric manager on NVSwitch systems), reset the GPU; a link "
              "that stays down: " + RMA)


def _same_model(gpu: Gpu, peers: list[Gpu]) -> list[Gpu]:
    return [p for p in peers if p.name == gpu.name and p.uuid != gpu.uuid]


def findings(gpu: Gpu, peers: list[Gpu]) -> list[Finding]:
    """What this GPU lacks of what it should have. `peers`: the node's GPUs NVML sees (this one may be among)."""
    found: list[Finding] = []

    def finding(check, expected, what, category, severity, action):
        found.append(Finding(gpu.index, gpu.uuid, check, expected, what, category, severity, action))

    if gpu.nvlinks_down:
        finding("NVLink down", f"all {gpu.nvlink_supported} NVLinks of the GPU up",
                f"link(s) {', '.join(map(str, gpu.nvlinks_down))} down ({gpu.nvlink_active} up)", "interconnect",
                "reset", NVLINK_FIX)
    same_model = _same_model(gpu, peers)
    expected_links = nvlinks_expected(gpu, same_model)
    if gpu.nvlink_supported is not None and gpu.nvlink_supported < expected_links:
        finding("NVLinks present", f"{expected_links} NVLinks, as the node's other {gpu.name} GPUs have",
                f"{gpu.nvlink_supported}", "interconnect", "isolate", NVLINK_FIX)

    gen, width = pcie_expected(gpu)
    if gen and gpu.pcie_gen and gpu.pcie_gen < gen:
        finding("PCIe generation allowed", f"gen{gen} (the GPU's own max)",
                f"gen{gpu.pcie_gen} at most in this slot/system", "interconnect", "triage", RESEAT)
    # At rest only the width is judged: an idle link lowers its generation to save power (judged under load).
    if width and gpu.pcie_width_current is not None and gpu.pcie_width_current < width:
        finding("PCIe link width", f"x{width} (the GPU's own max)", f"x{gpu.pcie_width_current} (downtrained)",
                "interconnect", "triage", RESEAT)

    most_memory = max([p.memory_total_bytes for p in same_model], default=0)
    if gpu.memory_total_bytes < most_memory:
        finding("memory size", f"{most_memory} bytes, as the node's other {gpu.name} GPUs have",
                f"{gpu.memory_total_bytes} bytes", "gpu-hardware", "reset", RESET)
    for what, attribute in (("max SM clock", "max_sm_clock_mhz"), ("max memory clock", "max_memory_clock_mhz")):
        fastest = max([getattr(p, attribute) or 0 for p in same_model], default=0)
        mine = getattr(gpu, attribute)
        if mine is not None and mine < fastest:
            finding(what, f"{fastest} MHz, as the node's other {gpu.name} GPUs have", f"{mine} MHz", "gpu-hardware",
                    "triage", "compare nvidia-smi -q -d CLOCK with the other GPUs (a clock cap, or another VBIOS)")
    return found


def pcie_under_load(gpu: Gpu, gen_now: int | None, width_now: int | None) -> Finding | None:
    """The PCIe link as read while a copy runs over it: then the generation too must be the GPU's own max."""
    gen, width = pcie_expected(gpu)
    if gen_now is None or width_now is None or not gen:
        return None
    if gen_now >= gen and width_now >= width:
        return None
    return Finding(gpu.index, gpu.uuid, "PCIe link under load", f"gen{gen} x{width} (the GPU's own max)",
                   f"gen{gen_now} x{width_now} while copying (downtrained)", "interconnect", "triage", RESEAT)


def unreachable(index: int, error: str) -> Finding:
    """A GPU NVML counts but cannot reach."""
    return Finding(index, "n/a", "GPU reachable", "an answer from NVML for the GPU", f"n/a: {error}",
                   "gpu-hardware", "isolate",
                   "the GPU fell off the bus or its driver state is broken (NVML's Unknown Error / GPU is lost): "
                   "drain the node, look for Xid 79 in the kernel log, reboot; if it recurs, " + RMA)


def missing_from_the_bus(addresses: list[str], nvml_sees: int) -> list[Finding]:
    """NVIDIA GPUs on the PCI bus that NVML does not show (fell off the bus, or the driver did not bind)."""
    return [Finding(None, "n/a", "GPU on the PCI bus", f"the GPU at PCI {address} visible to NVML",
                    f"on the bus, not among the {nvml_sees} GPU(s) NVML shows", "gpu-hardware", "isolate",
                    "drain the node; check the kernel log for Xid 79 / NVRM errors on this address and "
                    "nvidia-smi; reboot; if it stays missing, " + RMA) for address in addresses]


GPUS_MISSING = ("gpu-hardware", "isolate")  # GPUs the scheduler allocated or the PCI bus shows, not visible
GPU_HANG = ("gpu-hardware", "reset")  # the watchdog's stall of one rank that drives a GPU


def no_gpu_visible(expected: int, why: str, proven_there: bool) -> Finding:
    """No GPU visible where `expected` were asked for (`why`). `proven_there`: the scheduler allocated them or the
    PCI bus shows them, so the machine lost them (drain); otherwise the launch may have given the container none,
    which is the operator's to fix (alert)."""
    found, check = f"no GPU visible ({why})", f"no GPU visible, {why.split(' (')[0]}"
    if proven_there:
        return Finding(None, "n/a", check, f">= {expected} GPU(s)", found, *GPUS_MISSING,
                       "the GPUs are there but neither NVML nor CUDA reaches them: drain the node, check the "
                       "kernel log for Xid 79 / NVRM errors and nvidia-smi, reboot; if they stay missing, " + RMA)
    return Finding(None, "n/a", check, f">= {expected} GPU(s)", found, "configuration", "triage",
                   "give the container its GPUs (docker run --gpus all, or CDI; Kubernetes: an nvidia.com/gpu "
                   "limit; Slurm: gres.conf), or validate on CPU on purpose with --expect-gpus 0")


def stalled(check: str, message: str, ranks: list[int], gpus: dict[int, dict]) -> Finding:
    """The watchdog's stall of `ranks` in `check`. One stalled rank that drives a GPU (`gpus`: rank -> its GPU) is
    that GPU hung (a reset clears it); any other stall names no machine: the tool's timeout."""
    if len(ranks) == 1 and gpus.get(ranks[0]):
        gpu = gpus[ranks[0]]
        return Finding(gpu.get("index"), str(gpu.get("uuid", "")), check, "every rank to finish the check",
                       message, *GPU_HANG, RESET, rank=ranks[0],
                       pci_bus_id=str(gpu.get("pci_bus_id") or ""))
    return tool_error(check, message, "no single GPU is pinned: see every rank's stacks in the reports folder's "
                                      "logs/ (a slow filesystem, a starved CPU, or a hung collective)")
