"""How many GPUs a node must show, and from which evidence: a pure function of the --expect-gpus flag, the
environment the scheduler and the container runtime set, and the NVIDIA GPUs sysfs lists on the PCI bus. The
launcher (run/visibility.py) and the GPU check (smoke_tests/test_02_gpus.py) ask the same question here, and act
on the evidence's kind (`source`), never on the words that explain it (`why`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from stackproof.judge.findings import Finding, lost_gpu_fix

NO_GPU_VALUES = ("", "void", "none")

# Where the expectation came from.
FLAG = "flag"  # --expect-gpus
SCHEDULER = "scheduler"  # SLURM_GPUS_ON_NODE: the GPUs the job was given on this node
NONE_REQUESTED = "none requested"  # NVIDIA_VISIBLE_DEVICES=void (or unset, with no GPU on the bus)
DEVICE_LIST = "device list"  # CUDA_VISIBLE_DEVICES, or NVIDIA_VISIBLE_DEVICES naming devices
BUS = "PCI bus"  # every NVIDIA GPU sysfs lists
RUNTIME = "runtime"  # NVIDIA_VISIBLE_DEVICES=all with no bus visible: at least one


@dataclasses.dataclass(frozen=True)
class Expected:
    count: int  # 0: the run may use the CPU
    source: str
    why: str  # for people: the setting and its value


def expected_gpus(flag: int | None, env: Mapping[str, str], bus: Sequence[str] | None = None) -> Expected:
    """--expect-gpus wins; then the GPUs Slurm allocated on this node; then CUDA_VISIBLE_DEVICES or a container
    started for some GPUs (NVIDIA_VISIBLE_DEVICES listing devices, as the NVIDIA container toolkit and the
    Kubernetes device plugin set it) expect each one listed; NVIDIA_VISIBLE_DEVICES=void asks for none. Otherwise
    (bare metal, or NVIDIA_VISIBLE_DEVICES=all) every NVIDIA GPU on the PCI bus `bus` (sysfs) is expected; with
    no bus visible, NVIDIA_VISIBLE_DEVICES=all expects at least one and nothing else expects any."""
    if flag is not None:
        return Expected(flag, FLAG, f"--expect-gpus {flag}")
    slurm = env.get("SLURM_GPUS_ON_NODE")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        return Expected(int(slurm), SCHEDULER, f"SLURM_GPUS_ON_NODE={slurm} (the job's GPUs on this node)")
    requested = env.get("NVIDIA_VISIBLE_DEVICES")
    if requested is not None and requested.strip().lower() in NO_GPU_VALUES:
        return Expected(0, NONE_REQUESTED, f"no GPU requested (NVIDIA_VISIBLE_DEVICES={requested})")
    chosen = env.get("CUDA_VISIBLE_DEVICES")
    if chosen:  # within the container's GPUs, CUDA's list is what the ranks get
        return Expected(device_list(chosen), DEVICE_LIST, f"CUDA_VISIBLE_DEVICES={chosen}")
    if requested is not None and requested.strip().lower() != "all":
        return Expected(device_list(requested), DEVICE_LIST, f"NVIDIA_VISIBLE_DEVICES={requested}")
    if bus:
        return Expected(len(bus), BUS, f"{len(bus)} NVIDIA GPU(s) on the PCI bus ({', '.join(bus)})")
    if requested is not None:
        return Expected(1, RUNTIME, f"NVIDIA_VISIBLE_DEVICES={requested}")
    return Expected(0, NONE_REQUESTED, "no GPU requested (NVIDIA_VISIBLE_DEVICES unset) and none on the PCI bus")


def device_list(value: str) -> int:
    """How many GPUs a CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES list names (indices, UUIDs, MIG devices):
    each one is expected, so a node that lost 7 of the 8 its job was given does not pass with 1. CUDA stops at
    the first entry that names no device (-1, an empty entry)."""
    count = 0
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def lost_by_the_node(expected: Expected, seen: int, on_the_bus: int) -> bool:
    """Fewer GPUs than expected is the node's fault (its GPUs are lost: act drains) when the scheduler gave them
    to the job or the PCI bus shows them; fewer than a flag or a launch asked for may be the flag's or the
    launch's (configuration)."""
    return seen < expected.count and (expected.source == SCHEDULER or on_the_bus >= expected.count)


def gpus_lost(expected: Expected, seen: int) -> Finding:
    """The node's finding when lost_by_the_node: GPUs the scheduler allocated or the PCI bus shows, not visible."""
    return Finding(None, "", "GPUs visible", f">= {expected.count} GPU(s) ({expected.why})", f"{seen}",
                   "gpu-hardware", "isolate", lost_gpu_fix())


VISIBILITY_FIX = "check --gpus / CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES, and nvidia-smi on the host"


def seen_findings(expected: Expected, torch_count: int, nvml_visible: int, nvml_total: int, on_the_bus: int,
                  cuda_visible: str | None, not_to_nvml: Sequence[str] = ()) -> list[Finding]:
    """What torch and NVML see against what was expected: GPUs the scheduler allocated or the bus shows, lost
    (the node's fault: gpus_lost); else torch and NVML disagreeing, or fewer than a flag or a launch asked for
    (the flag's or the launch's: configuration)."""
    if lost_by_the_node(expected, torch_count, on_the_bus):
        return [gpus_lost(expected, torch_count)]
    if torch_count != nvml_visible:
        return [Finding(None, "", "GPUs visible to torch and NVML", f"torch.cuda.device_count() = NVML's "
                        f"{nvml_visible} visible (CUDA_VISIBLE_DEVICES={cuda_visible}, NVML total {nvml_total})",
                        f"{torch_count}", "configuration", "triage", VISIBILITY_FIX)]
    if torch_count < expected.count:
        gone = f"; on the bus but not to NVML: {', '.join(not_to_nvml)}" if not_to_nvml else ""
        return [Finding(None, "", "GPUs visible", f">= {expected.count} GPU(s) ({expected.why})",
                        f"{torch_count}{gone}", "configuration", "triage", VISIBILITY_FIX)]
    return []
