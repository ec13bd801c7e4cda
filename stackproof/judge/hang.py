"""A stalled check, judged per stalled rank: a GPU hang (gpu-hardware, reset: drain) only when the rank's main
thread is inside a CUDA call (torch.cuda's code, or blocked in the driver's ioctl) and NVML agrees (a kernel still
running on its GPU, or NVML failing for it); anything else (a slow NFS write, a starved CPU, Python busy) is a
tool timeout, which names no machine. Pure: the watchdog's answers in (run/watchdog.py), findings out."""

from __future__ import annotations

from typing import Any

from stackproof.judge.findings import RESET, Finding

# NVML's words for a GPU in trouble (and measure/stall.py's for NVML not answering in time).
GPU_TROUBLE = ("no answer", "GPU is lost", "Unknown Error", "GPU requires restart")


def nvml_agrees(answer: dict[str, Any]) -> bool:
    """NVML says the GPU is busy or in trouble while its rank is stalled."""
    error = answer.get("gpu_error") or ""
    return bool(answer.get("gpu_util")) or any(words in error for words in GPU_TROUBLE)


def pinned_on_gpu(answer: dict[str, Any]) -> bool:
    return bool(answer.get("in_cuda")) and nvml_agrees(answer)


def hang_finding(what: str, rank: int, answer: dict[str, Any], limit_s: float) -> Finding:
    """One stalled rank (not waiting for its peers): a GPU hang, or a tool timeout."""
    gpu = answer.get("gpu") or {}
    seen = (f"rank {rank} at {answer.get('where', 'unknown')}; native: {answer.get('native', 'n/a')}; GPU "
            f"utilization {answer.get('gpu_util', 'n/a')}%" + (f" ({answer['gpu_error']})" if answer.get("gpu_error")
                                                             else ""))
    if gpu and pinned_on_gpu(answer):
        return Finding(gpu.get("index"), gpu.get("uuid", "n/a"), "GPU hang", f"{what} within {limit_s:.0f} s",
                       f"stalled inside a CUDA call ({answer['in_cuda']}): {seen}", "gpu-hardware", "reset",
                       RESET + "; the rank's log has its stack", node=answer.get("node", ""), rank=rank,
                       pci_bus_id=gpu.get("pci_bus_id", ""), source="watchdog")
    return Finding(gpu.get("index"), gpu.get("uuid", "n/a"), "check timed out", f"{what} within {limit_s:.0f} s",
                   f"stalled outside any CUDA call the GPU is still busy with: {seen}", "tool-error", "triage",
                   "the rank's log has its stack: a slow file system, a starved CPU or a check waiting on itself; "
                   "raise --check-timeout if the node is merely slow", node=answer.get("node", ""), rank=rank,
                   pci_bus_id=gpu.get("pci_bus_id", ""), source="watchdog")
