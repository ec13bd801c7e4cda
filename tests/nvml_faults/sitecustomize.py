"""Break the real nvidia-ml-py beneath stackproof, as a faulty GPU would answer, in every process that starts with
this directory on PYTHONPATH (the launcher and every rank): NVML_FAULT names the fault. For the GPU machine's
boundary-fault runs (docs/report-format.md, "Proved on an H200"); CI replays recordings instead (tests/nvml_replay).

  ecc-off        nvmlDeviceGetEccMode answers (0, 0)
  pcie-gen3x8    the link runs at gen3 x8 (current generation and width), at rest and under load
  clocks-0x60    clock-event reasons 0x60: HW + SW thermal slowdown
  unknown-error  nvmlDeviceGetHandleByIndex raises NVML's Unknown Error (a GPU that fell off the bus)
  gpu-lost       nvmlDeviceGetHandleByIndex raises NVML's GPU is lost (Xid 79's aftermath)
"""

import os

FAULT = os.environ.get("NVML_FAULT")

if FAULT:
    import pynvml

    def _unknown(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    def _lost(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    patches = {
        "ecc-off": {"nvmlDeviceGetEccMode": lambda handle: [0, 0]},
        "pcie-gen3x8": {"nvmlDeviceGetCurrPcieLinkGeneration": lambda handle: 3,
                        "nvmlDeviceGetCurrPcieLinkWidth": lambda handle: 8},
        "clocks-0x60": {"nvmlDeviceGetCurrentClocksEventReasons": lambda handle: 0x60},
        "unknown-error": {"nvmlDeviceGetHandleByIndex": _unknown},
        "gpu-lost": {"nvmlDeviceGetHandleByIndex": _lost},
    }[FAULT]
    for name, patched in patches.items():
        setattr(pynvml, name, patched)
