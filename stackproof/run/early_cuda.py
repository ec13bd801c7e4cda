"""A rank's CUDA context, created while the rank imports torch: `import torch` takes seconds and needs no GPU,
creating the context takes most of a second and needs no torch. The context made here through the driver API
is the device's primary context, the one the CUDA runtime (torch) uses, so torch.cuda.set_device later finds it
ready. Best effort: whatever fails here, torch's own initialisation meets again, and reports."""

from __future__ import annotations

import ctypes
import threading


def start(local_rank: int) -> None:
    threading.Thread(target=_retain_primary_context, args=(local_rank,), name="stackproof-early-cuda",
                     daemon=True).start()


def _retain_primary_context(local_rank: int) -> None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return  # no driver here: torch sees no GPU, and the run says so
    device, context = ctypes.c_int(), ctypes.c_void_p()
    # ctypes releases the GIL during each call: the import goes on meanwhile. Any error code: leave it to torch.
    if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), local_rank) == 0:
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
