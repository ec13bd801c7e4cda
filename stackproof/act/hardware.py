"""What the machine itself shows, read by healthcheck on the node: NVIDIA GPUs on the PCI bus (sysfs), the
evidence that a run which saw no GPU (exit 3) is the node's fault and not the launch's; and which GPUs a job is
using (NVML), which --skip-busy-gpus leaves alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (data-centre GPUs are 3D controllers)


def nvidia_gpus_on_pci(root: Path = PCI_DEVICES) -> int:
    """How many NVIDIA display / 3D controllers the PCI bus lists; 0 where sysfs cannot be read."""
    count = 0
    try:
        devices = list(root.iterdir())
    except OSError:
        return 0
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip().lower()
            klass = (device / "class").read_text().strip().lower()
        except OSError:
            continue
        count += vendor == NVIDIA_VENDOR and klass.startswith(GPU_CLASSES)
    return count


@dataclasses.dataclass(frozen=True)
class GpuUse:
    index: int
    uuid: str
    pids: tuple[int, ...]  # processes computing or drawing on it (a job's), as NVML lists them


def gpu_use() -> list[GpuUse] | None:
    """Every GPU NVML sees and who uses it; None when NVML cannot answer (then nothing can be skipped)."""
    from stackproof.suite.topology import NvmlUnavailable, nvml_session

    try:
        with nvml_session() as nvml:
            use = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                procs = [*nvml.nvmlDeviceGetComputeRunningProcesses(handle),
                         *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)]
                use.append(GpuUse(index, str(nvml.nvmlDeviceGetUUID(handle)), tuple(sorted({p.pid for p in procs}))))
            return use
    except NvmlUnavailable:
        return None
    except Exception as err:  # an NVML error mid-way (a GPU lost): say so, skip nothing
        raise NvmlUnavailable(f"NVML could not list the GPUs' processes: {err}") from err


@dataclasses.dataclass(frozen=True)
class IdlePlan:
    cuda_visible_devices: str | None  # the idle GPUs (UUIDs), or None: every GPU is idle, nothing to change
    expect_gpus: int | None
    words: str  # what is skipped and why, for the log
    nothing_idle: bool = False


def idle_plan(use: list[GpuUse], expect_gpus: int | None) -> IdlePlan:
    """Check only the GPUs no process uses (a job's GPUs are measured by no one but the job): the busy ones are
    hidden from the run and taken off what it expects."""
    busy = [g for g in use if g.pids]
    if not busy:
        return IdlePlan(None, expect_gpus, "")
    idle = [g for g in use if not g.pids]
    named = "; ".join(f"GPU {g.index} {g.uuid} (pid {', '.join(map(str, g.pids))})" for g in busy)
    expect = None if expect_gpus is None else max(0, expect_gpus - len(busy))
    if not idle:
        return IdlePlan(None, expect, f"every GPU is in use, not checked: {named}", nothing_idle=True)
    return IdlePlan(",".join(g.uuid for g in idle), expect,
                    f"skipping {len(busy)} GPU(s) in use: {named}; checking {len(idle)}"
                    + (f", expecting {expect}" if expect is not None else ""))
