"""What an exception that escaped a check says about the machine: usually nothing. A check's own judgement of the
machine is a finding it hands over, or its assertion (classified by the check); any other exception is a tool
error, except the few whose words are the driver's or the library's own about the GPU or the image. Pure: the
exception's type name and message in, a Finding out (tested without torch)."""

from __future__ import annotations

from stackproof.judge.findings import RESET, Finding, tool_error

# (words in the exception's message, category, severity, fix); the first match wins. The words are CUDA's,
# the driver's and torch's own messages (cudaGetErrorString, c10/cuda), not stackproof's.
KNOWN: tuple[tuple[tuple[str, ...], str, str, str], ...] = (
    (("out of memory",), "configuration", "triage",
     "another process holds this GPU's memory, or the check asked for more than is free: see the health check's "
     "list of other processes on the GPU; stop them (or reset the GPU) before the next job"),
    (("no kernel image is available", "not compatible with the current pytorch installation",
      "cuda capability sm_"), "software-pins", "triage",
     "this torch was built without kernels for this GPU's architecture: use an image whose torch lists the GPU's "
     "compute capability (torch.cuda.get_arch_list())"),
    (("uncorrectable ecc error", "fallen off the bus", "gpu is lost", "unspecified launch failure",
      # cudaErrorHardwareStackError, cudaErrorIllegalInstruction (the context is lost: CUDA's own words), and
      # NCCL's ncclUnhandledCudaError: a CUDA call inside NCCL failed (after an XID, the usual cause)
      "hardware stack error", "illegal instruction was encountered", "unhandled cuda error"),
     "gpu-hardware", "reset", RESET),
    (("uncorrectable nvlink error",), "interconnect", "reset",  # cudaErrorNvlinkUncorrectable
     "an NVLink between this node's GPUs failed: reset the GPUs (nvidia-smi -r) and read the NVLink error counters "
     "(nvidia-smi nvlink -e); replace the board or the bridge if it recurs"),
    (("driver version is insufficient", "cuda driver version", "forward compatibility was attempted"),
     "configuration", "triage",
     "the node's NVIDIA driver is older than the image's CUDA needs: upgrade the driver, or use an image built "
     "for this driver (images/matrix.toml says which)"),
)


def finding(check: str, type_name: str, message: str, where: str = "") -> Finding:
    """The finding for an exception of `type_name` with `message`, raised in `check` (at `where`, file:line)."""
    found = f"{type_name}: {' '.join(message.split())[:300]}" + (f" (at {where})" if where else "")
    lowered = message.lower()
    for words, category, severity, fix in KNOWN:
        if any(w in lowered for w in words):
            return Finding(None, "", check, "the check to run without an error", found, category, severity, fix)
    return tool_error(check, found)
