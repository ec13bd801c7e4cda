"""Where a stalled rank's main thread is, below Python, and what NVML says of its GPU meanwhile: the evidence that
pins a hang on the GPU (judge/hang.py), or not. Read by the rank's watchdog thread while the main thread is stuck;
every NVML call here has a deadline (a hung GPU can hang NVML too, and that is itself an answer)."""

from __future__ import annotations

import dataclasses
import os
import platform
import threading
from pathlib import Path

IOCTL = {"x86_64": 16, "aarch64": 29}.get(platform.machine())  # the syscall the driver's calls go through
NVML_DEADLINE_S = 3.0
NO_ANSWER = "no answer"


@dataclasses.dataclass(frozen=True)
class Native:
    state: str  # the thread's scheduler state: R running, S sleeping, D uninterruptible, ...
    syscall: str  # "running" (in user space), "ioctl /dev/nvidia0", "syscall 7 (fd /dev/pts/1)", "n/a"
    in_gpu_driver: bool  # blocked in an ioctl on an NVIDIA device file: inside a CUDA driver call


def native(tid: int | None = None, proc: str = "/proc/self") -> Native:
    """The main thread's (or `tid`'s) state and syscall from /proc."""
    tid = tid or threading.main_thread().native_id
    task = Path(proc) / "task" / str(tid)
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        fields = (task / "syscall").read_text().split()
    except (OSError, IndexError):
        return Native("n/a", "n/a", False)
    return native_of(state, fields, lambda fd: os.readlink(Path(proc) / "fd" / str(fd)))


def native_of(state: str, fields: list[str], fd_target) -> Native:
    """Native from /proc/<tid>/stat's state and /proc/<tid>/syscall's fields ("running", or the number and its
    arguments in hex); `fd_target(fd)` names what an fd is open on."""
    if not fields or fields[0] == "running":
        return Native(state, "running", False)
    if fields[0] == "-1" or not fields[0].isdigit() or len(fields) < 2:
        return Native(state, "n/a", False)
    number = int(fields[0])
    try:
        target = fd_target(int(fields[1], 16))
    except (OSError, ValueError):
        target = ""
    if number == IOCTL and target.startswith("/dev/nvidia"):
        return Native(state, f"ioctl {target}", True)
    return Native(state, f"syscall {number}" + (f" (fd {target})" if target else ""), False)


@dataclasses.dataclass(frozen=True)
class GpuActivity:
    utilization: int | None  # % of the last sample period a kernel ran; None: not read
    error: str = ""  # NVML's error, or NO_ANSWER when it did not answer within its deadline


def gpu_activity(uuid: str, deadline_s: float = NVML_DEADLINE_S) -> GpuActivity:
    """NVML's view of the GPU while its rank is stalled: a kernel still running (utilization), or NVML's error."""
    answer = [GpuActivity(None, NO_ANSWER)]

    def ask() -> None:
        from stackproof.measure.topology import NvmlUnavailable, nvml_session

        try:
            with nvml_session() as nvml:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
                answer[0] = GpuActivity(int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        except NvmlUnavailable as err:
            answer[0] = GpuActivity(None, str(err))
        except Exception as err:  # NVMLError: GPU lost, unknown error...
            answer[0] = GpuActivity(None, f"NVML error {err}")

    worker = threading.Thread(target=ask, name="stall-nvml", daemon=True)
    worker.start()
    worker.join(deadline_s)
    return answer[0]
