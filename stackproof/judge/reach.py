"""Why no GPU is visible where GPUs were expected (exit 3), judged from measure/cuda_reach.py's reading: only the
GPUs being there (NVML counts them) while CUDA cannot reach them is the node's hardware (drain); a CPU-only torch,
a container without the NVIDIA runtime, a driver whose user-space library does not match the kernel module (after
an upgrade, before the reboot), a driver too old for the image's CUDA are configuration (alert), each with its
fix. Pure: a Reach in, one finding out (the first cause, in the order a person would look)."""

from __future__ import annotations

from stackproof.judge.findings import Finding
from stackproof.judge.readings import Reach

# NVML's error codes (nvml.h), at nvmlInit.
NVML_DRIVER_NOT_LOADED, NVML_LIBRARY_NOT_FOUND, NVML_LIB_RM_VERSION_MISMATCH = 9, 12, 18
# The CUDA driver API's (cuda.h CUresult), at cuInit.
CUDA_INSUFFICIENT_DRIVER, CUDA_DEVICES_UNAVAILABLE, CUDA_NO_DEVICE = 35, 46, 100
CUDA_SYSTEM_NOT_READY, CUDA_SYSTEM_DRIVER_MISMATCH, CUDA_COMPAT_NOT_SUPPORTED = 802, 803, 804
NO_ANSWER = -1  # cuda_reach.NO_ANSWER: the call hung

RUNTIME_FIX = ("start the container with the NVIDIA runtime and its GPUs (docker run --gpus all, or --device "
               "nvidia.com/gpu=all with CDI; Kubernetes: runtimeClassName nvidia and an nvidia.com/gpu limit, and "
               "the pod scheduled after the GPU operator's driver and toolkit are ready)")


def no_gpu(reach: Reach, expected: int, why: str) -> Finding:
    """The one finding that says why CUDA shows no GPU here although `expected` were (`why`: who expects them)."""

    def node(check: str, want: str, found: str, category: str, severity: str, fix: str) -> Finding:
        return Finding(None, "n/a", check, want, found, category, severity, fix)

    want = f">= {expected} GPU(s) ({why})"
    if reach.torch_version is not None and reach.torch_cuda is None:
        return node("torch's CUDA build", "a torch built for CUDA", f"torch {reach.torch_version} is a CPU-only "
                    "build", "configuration", "triage", "install the image's CUDA build of torch (stackproof's "
                    "images pin it; pip: the wheel index of the CUDA version, e.g. .../whl/cu130)")
    if reach.nvml_error == NVML_LIB_RM_VERSION_MISMATCH or reach.cuda_error == CUDA_SYSTEM_DRIVER_MISMATCH:
        return node("NVIDIA driver", "the kernel module and its user-space library of one version",
                    f"driver/library version mismatch (NVML: {reach.nvml_words or 'n/a'}; cuInit: "
                    f"{reach.cuda_words or 'n/a'})", "configuration", "reset",
                    "reboot the node (or unload and reload the nvidia kernel modules) after the driver upgrade, so "
                    "the loaded module matches the installed libraries")
    if reach.nvml_error == NVML_DRIVER_NOT_LOADED:
        return node("NVIDIA driver", "the nvidia kernel module loaded", f"not loaded ({reach.nvml_words})",
                    "configuration", "reset", "load it (modprobe nvidia) or reboot; the kernel log says why it did "
                    "not load (a kernel update without the module rebuilt, Secure Boot)")
    if reach.nvml_error == NVML_LIBRARY_NOT_FOUND or (reach.nvml_gpus is None and reach.cuda_error is None):
        return node("NVIDIA runtime", "the driver's libraries in this container (libnvidia-ml, libcuda)",
                    f"NVML: {reach.nvml_words or 'n/a'}; CUDA: {reach.cuda_words or 'n/a'}", "configuration",
                    "triage", RUNTIME_FIX)
    if reach.nvml_gpus is None:
        return node("NVML", "NVML started and counting the GPUs", f"n/a: {reach.nvml_words}", "configuration",
                    "reset", "run nvidia-smi on the node: if it fails the same way, reboot it; if it recurs, the "
                    "kernel log names the GPU (look for an XID)")
    if reach.nvml_gpus == 0:
        return node("GPUs given to the container", want, "NVML counts 0 GPUs here", "configuration", "triage",
                    RUNTIME_FIX)
    if reach.cuda_error is None:
        return node("CUDA driver library", "libcuda.so.1 loadable", reach.cuda_words, "configuration", "triage",
                    "give the container the compute capability (NVIDIA_DRIVER_CAPABILITIES including compute; "
                    "stackproof images set compute,utility)")
    if reach.cuda_error in (CUDA_INSUFFICIENT_DRIVER, CUDA_COMPAT_NOT_SUPPORTED):
        return node("driver for the image's CUDA", f"a driver that runs CUDA {reach.torch_cuda or 'n/a'}",
                    f"cuInit: {reach.cuda_words}", "configuration", "triage",
                    "install a newer driver on the node, or run an image built for an older CUDA")
    if reach.cuda_error == CUDA_SYSTEM_NOT_READY:
        return node("NVSwitch fabric", "the fabric manager running", f"cuInit: {reach.cuda_words}", "configuration",
                    "reset", "start nvidia-fabricmanager (systemctl start nvidia-fabricmanager) on NVSwitch systems")
    if reach.cuda_error == CUDA_DEVICES_UNAVAILABLE:
        return node("GPUs free", "GPUs this process may use", f"cuInit: {reach.cuda_words} (exclusive-process mode, "
                    "held by another process)", "configuration", "triage",
                    "stop the process holding the GPUs (nvidia-smi), or set the compute mode to default (nvidia-smi "
                    "-c 0)")
    if reach.cuda_error == CUDA_NO_DEVICE and not reach.device_files:
        return node("GPU device files", "/dev/nvidia<N> for the GPUs NVML counts",
                    f"none in this container; NVML counts {reach.nvml_gpus}", "configuration", "triage", RUNTIME_FIX)
    if reach.cuda_error == 0 and reach.cuda_gpus:
        return node("GPUs visible to this process", want, f"CUDA counts {reach.cuda_gpus} GPU(s) in all, none of "
                    f"them left visible (CUDA_VISIBLE_DEVICES={reach.cuda_visible_devices})", "configuration",
                    "triage", "fix CUDA_VISIBLE_DEVICES (indices or UUIDs of this node's GPUs), or unset it")
    # NVML counts the GPUs, the runtime gave them, the driver matches, and CUDA still reaches none: the GPUs.
    return node("CUDA reaches the GPUs", f"the {reach.nvml_gpus} GPU(s) NVML counts usable by CUDA",
                f"cuInit: {reach.cuda_words}" + (" (hung)" if reach.cuda_error == NO_ANSWER else ""),
                "gpu-hardware", "reset", "drain the node; reset the GPUs (nvidia-smi -r) or reboot; the kernel log "
                "names the XID; if it recurs, RMA the GPU quoting its serial number")
