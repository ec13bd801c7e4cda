"""One reading of the health counters DCGM watches (judge/counters.py has the rules): NVML's PCIe replay counter,
ECC counts, retired pages by cause, remapped rows, power limits, application clocks, the NVLink fabric state,
the driver's recovery action, pending ECC / MIG modes, and the PCIe AER counters from sysfs. A call the GPU or
driver lacks (NotSupported, FunctionNotFound, absent from this nvidia-ml-py) reads None; any other NVML error
is kept in `errors`, to be judged like every NVML error (judge/health.nvml_error_finding)."""

from __future__ import annotations

import ctypes
import os
import time

from stackproof.judge.counters import CounterReading
from stackproof.measure import topology

AER_FILES = {"correctable": ("aer_dev_correctable", "TOTAL_ERR_COR"),
             "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
             "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL")}


def supported(nvml, errors: dict[str, str], what: str, name: str, *args):
    """nvml.`name`(*args), or None where the GPU or driver does not have it."""
    call = getattr(nvml, name, None)
    if call is None:
        return None
    try:
        return call(*args)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
        return None
    except nvml.NVMLError as err:
        errors[what] = f"NVML error {err}"
        return None


def _field(nvml, handle, errors: dict[str, str], what: str, field_name: str) -> int | None:
    field_id = getattr(nvml, field_name, None)
    values = None if field_id is None else supported(nvml, errors, what, "nvmlDeviceGetFieldValues", handle,
                                                     [field_id])
    if not values or values[0].nvmlReturn in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
        return None
    if values[0].nvmlReturn != nvml.NVML_SUCCESS:
        errors[what] = f"NVML error {nvml.NVMLError(values[0].nvmlReturn)}"
        return None
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    return int(getattr(values[0].value, member.get(values[0].valueType, "ullVal")))


def _fabric(nvml, handle, errors: dict[str, str]):
    """NVML fills a caller's structure with the fabric state (nvidia-ml-py passes it through); a replayed NVML
    answers it instead."""
    make = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if make is None:
        return None
    info = make()
    answer = supported(nvml, errors, "GPU fabric info", "nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info))
    if answer is None:
        return None
    return answer if hasattr(answer, "state") else info


def read_aer(pci_root: str, pci_bus_id: str | None) -> dict[str, int] | None:
    """The AER totals the kernel counts for the GPU's PCI function since boot; None without AER in sysfs."""
    if not pci_bus_id:
        return None
    domain, rest = pci_bus_id.lower().split(":", 1)
    folder = os.path.join(pci_root, f"{int(domain, 16):04x}:{rest}")
    found = {}
    for kind, (name, total) in AER_FILES.items():
        try:
            with open(os.path.join(folder, name)) as counts:
                lines = dict(line.rsplit(None, 1) for line in counts if line.strip())
        except (OSError, ValueError):
            continue
        if total in lines:
            found[kind] = int(lines[total])
    return found or None


def read(nvml, handle, gpu: topology.Gpu, pci_root: str = topology.PCI_DEVICES) -> CounterReading:
    reading = CounterReading(seconds=time.monotonic(), pcie_gen=gpu.pcie_gen_gpu_max or gpu.pcie_gen or None,
                             pcie_width=gpu.pcie_width_gpu_max or gpu.pcie_width or None)
    errors = reading.errors

    def ask(what, name, *args):
        return supported(nvml, errors, what, name, handle, *args)

    reading.pcie_replays = ask("PCIe replay counter", "nvmlDeviceGetPcieReplayCounter")
    ecc = (("sbe_volatile", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC),
           ("sbe_aggregate", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_AGGREGATE_ECC),
           ("dbe_aggregate", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_AGGREGATE_ECC))
    for name, kind, counter in ecc:
        setattr(reading, name, ask(f"ECC {name.replace('_', ' ')}", "nvmlDeviceGetTotalEccErrors", kind, counter))
    for name, cause in (("retired_sbe_pages", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                        ("retired_dbe_pages", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)):
        pages = ask(f"{name.replace('_', ' ')}", "nvmlDeviceGetRetiredPages", cause)
        setattr(reading, name, None if pages is None else len(pages))
    rows = ask("remapped rows", "nvmlDeviceGetRemappedRows")
    reading.remapped_uncorrectable = None if rows is None else int(rows[1])
    reading.power_enforced_mw = ask("enforced power limit", "nvmlDeviceGetEnforcedPowerLimit")
    reading.power_default_mw = ask("default power limit", "nvmlDeviceGetPowerManagementDefaultLimit")
    for clock, kind in (("sm", nvml.NVML_CLOCK_SM), ("mem", nvml.NVML_CLOCK_MEM)):
        reading.app_clocks_mhz[clock] = ask(f"application clock {clock}", "nvmlDeviceGetApplicationsClock", kind)
        reading.default_app_clocks_mhz[clock] = ask(f"default application clock {clock}",
                                                    "nvmlDeviceGetDefaultApplicationsClock", kind)
    fabric = _fabric(nvml, handle, errors)
    if fabric is not None:
        reading.fabric_state, reading.fabric_status = int(fabric.state), int(fabric.status)
    reading.recovery_action = _field(nvml, handle, errors, "GPU recovery action",
                                     "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
    for name, call in (("ecc_mode", "nvmlDeviceGetEccMode"), ("mig_mode", "nvmlDeviceGetMigMode")):
        mode = ask(name.replace("_", " "), call)
        setattr(reading, name, None if mode is None else (int(mode[0]), int(mode[1])))
    reading.aer = read_aer(pci_root, gpu.pci_bus_id)
    return reading
