"""Which GPUs a job is using (NVML), which healthcheck --skip-busy-gpus leaves alone. (The NVIDIA GPUs on the PCI
bus, the evidence that a run which saw no GPU is the node's fault: topology.nvidia_gpus_on_bus.)"""

from __future__ import annotations

import dataclasses

from stackproof.measure.topology import SURVEY_DEADLINE_S


@dataclasses.dataclass(frozen=True)
class GpuUse:
    index: int
    uuid: str
    pids: tuple[int, ...]  # processes computing or drawing on it (a job's), as NVML lists them


def gpu_use(deadline_s: float = SURVEY_DEADLINE_S) -> list[GpuUse]:
    """Every GPU NVML sees and who uses it. NvmlUnavailable when NVML cannot answer (no driver, no nvidia-ml-py,
    an error mid-way, no answer within `deadline_s`: NVML is asked from a thread of its own, left behind when it
    hangs in the driver): then nothing can be skipped, and the caller says so (--skip-busy-gpus promises to name
    what it skips: skipping nothing without a word would look like every GPU was idle)."""
    import threading

    from stackproof.measure.topology import NvmlUnavailable

    answers: dict[str, object] = {}

    def ask() -> None:
        try:
            answers["use"] = _gpu_use()
        except BaseException as err:  # raised where the caller waits, not lost in the thread
            answers["error"] = err

    worker = threading.Thread(target=ask, name="nvml-gpu-use", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise NvmlUnavailable(f"NVML did not answer within {deadline_s:g} s (listing the GPUs' processes)")
    if "error" in answers:
        raise answers["error"]  # type: ignore[misc]
    return answers["use"]  # type: ignore[return-value]


def _gpu_use() -> list[GpuUse]:
    from stackproof.measure.topology import NvmlUnavailable, nvml_session

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
        raise
    except Exception as err:  # an NVML error mid-way (a GPU lost): say so, skip nothing
        raise NvmlUnavailable(f"NVML could not list the GPUs' processes: {err}") from err


@dataclasses.dataclass(frozen=True)
class IdlePlan:
    cuda_visible_devices: str | None  # the idle GPUs (UUIDs), or None: every GPU is idle, nothing to change
    expect_gpus: int | None
    words: str  # what is skipped and why, for the log
    nothing_idle: bool = False
    skipped: str | None = None  # the busy GPUs' UUIDs, comma-separated (validate --skipped-gpus: the spec counts them)


def idle_plan(use: list[GpuUse], expect_gpus: int | None) -> IdlePlan:
    """Check only the GPUs no process uses (a job's GPUs are measured by no one but the job): the busy ones are
    hidden from the run and taken off what it expects."""
    busy = [g for g in use if g.pids]
    if not busy:
        return IdlePlan(None, expect_gpus, "")
    skipped = ",".join(g.uuid for g in busy)
    idle = [g for g in use if not g.pids]
    named = "; ".join(f"GPU {g.index} {g.uuid} (pid {', '.join(map(str, g.pids))})" for g in busy)
    expect = None if expect_gpus is None else max(0, expect_gpus - len(busy))
    if not idle:
        return IdlePlan(None, expect, f"every GPU is in use, not checked: {named}", nothing_idle=True, skipped=skipped)
    return IdlePlan(",".join(g.uuid for g in idle), expect,
                    f"skipping {len(busy)} GPU(s) in use: {named}; checking {len(idle)}"
                    + (f", expecting {expect}" if expect is not None else ""), skipped=skipped)
