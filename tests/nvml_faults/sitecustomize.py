"""Break the real nvidia-ml-py beneath stackproof, as a faulty GPU would answer, in every process that starts with
this directory on PYTHONPATH (the launcher and every rank): NVML_FAULT names the fault. For the GPU machine's
boundary-fault runs (docs/report-format.md, "Proved on an H200"); CI replays recordings instead (tests/nvml_replay).

  ecc-off        nvmlDeviceGetEccMode answers (0, 0)
  pcie-gen3x8    the link runs at gen3 x8 (current generation and width), at rest and under load
  clocks-0x60    clock-event reasons 0x60: HW + SW thermal slowdown
  unknown-error  nvmlDeviceGetHandleByIndex raises NVML's Unknown Error (a GPU that fell off the bus)
  gpu-lost       nvmlDeviceGetHandleByIndex raises NVML's GPU is lost (Xid 79's aftermath)
  pcie-replays   the PCIe replay counter climbs by 5000 at every reading
  sbe-312k       312000 corrected (single-bit) ECC errors since the driver loaded, climbing by 1000 a reading
  power-60       the enforced power limit at 60 % of the board's default
"""

import os

FAULT = os.environ.get("NVML_FAULT")

if FAULT:
    import pynvml

    def _unknown(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    def _lost(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    def _climbing(start, step, real=None):
        state = {"value": start}

        def answer(handle, *args):
            if real is not None and args[:2] != (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC):
                return real(handle, *args)
            state["value"] += step
            return state["value"]
        return answer

    patches = {
        "ecc-off": {"nvmlDeviceGetEccMode": lambda handle: [0, 0]},
        "pcie-gen3x8": {"nvmlDeviceGetCurrPcieLinkGeneration": lambda handle: 3,
                        "nvmlDeviceGetCurrPcieLinkWidth": lambda handle: 8},
        "clocks-0x60": {"nvmlDeviceGetCurrentClocksEventReasons": lambda handle: 0x60},
        "unknown-error": {"nvmlDeviceGetHandleByIndex": _unknown},
        "gpu-lost": {"nvmlDeviceGetHandleByIndex": _lost},
        "pcie-replays": {"nvmlDeviceGetPcieReplayCounter": _climbing(0, 5000)},
        "sbe-312k": {"nvmlDeviceGetTotalEccErrors": _climbing(311_000, 1000, pynvml.nvmlDeviceGetTotalEccErrors)},
        "power-60": {"nvmlDeviceGetEnforcedPowerLimit":
                     lambda handle: int(0.6 * pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))},
    }[FAULT]
    for name, patched in patches.items():
        setattr(pynvml, name, patched)
