"""Unit tests of the per-GPU proof tier: the peaks derived from NVML values (H200 as the known answer), the
digest chain, the cross-rank decisions, and every NVML failure path of topology.py and health.py.

NVML cannot run without an NVIDIA driver, so each NVML test hands in `FakeNvml`: the real nvidia-ml-py module's
constants and exception classes, with one GPU's answers in place of the driver's."""

import pynvml
import pytest

from stackproof.suite import topology


class Fails:
    """An answer that raises the real pynvml exception for an NVML return code."""

    def __init__(self, code: int):
        self.code = code


class FakeNvml:
    """pynvml with one GPU: `answers` maps an nvmlDevice* function to its value, to a function of the call's
    arguments after the handle, or to Fails(code). Functions not answered say NotSupported, as NVML does for
    features a GPU lacks."""

    def __init__(self, **answers):
        self.answers = answers

    def __getattr__(self, name):
        if not name.startswith("nvmlDevice"):
            return getattr(pynvml, name)  # constants and exception classes: the real ones
        answer = self.answers.get(name, Fails(pynvml.NVML_ERROR_NOT_SUPPORTED))

        def call(handle=None, *args):
            value = answer(*args) if callable(answer) else answer
            if isinstance(value, Fails):
                raise pynvml.NVMLError(value.code)
            return value

        return call


class PciInfo:
    busId = b"00000000:18:00.0"


class Memory:
    total = 141 * (1 << 30)


H200_ANSWERS = {  # what NVML answered on an H200 (retired pages: NotSupported, the GPU remaps rows instead)
    "nvmlDeviceGetHandleByIndex": "handle", "nvmlDeviceGetHandleByUUID": "handle",
    "nvmlDeviceGetName": "NVIDIA H200", "nvmlDeviceGetUUID": "GPU-8c1d7f3a-0000-4000-8000-000000000001",
    "nvmlDeviceGetMemoryInfo": Memory(), "nvmlDeviceGetSerial": "1654123456789", "nvmlDeviceGetPciInfo": PciInfo(),
    "nvmlDeviceGetNvLinkState": lambda link: pynvml.NVML_FEATURE_ENABLED if link < 18 else Fails(
        pynvml.NVML_ERROR_INVALID_ARGUMENT),
    "nvmlDeviceGetMaxPcieLinkGeneration": 5, "nvmlDeviceGetMaxPcieLinkWidth": 16,
    "nvmlDeviceGetCurrPcieLinkGeneration": 1, "nvmlDeviceGetCurrPcieLinkWidth": 16,
    "nvmlDeviceGetMemoryBusWidth": 6016,
    "nvmlDeviceGetMaxClockInfo": lambda clock: {pynvml.NVML_CLOCK_MEM: 3201, pynvml.NVML_CLOCK_SM: 1980}[clock],
    "nvmlDeviceGetTotalEccErrors": lambda kind, counter: 0,
    "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
    "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonGpuIdle,
    "nvmlDeviceGetNvLinkErrorCounter": lambda link, counter: 0,
    "nvmlDeviceGetTemperature": lambda sensor: 31,
    "nvmlDeviceGetTemperatureThreshold": lambda kind: {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 87}.get(
        kind, Fails(pynvml.NVML_ERROR_NOT_SUPPORTED)),
}


def h200_nvml(**changes) -> FakeNvml:
    return FakeNvml(**{**H200_ANSWERS, **changes})


def test_inventory_reads_identity_and_the_values_the_bars_derive_from():
    gpu = topology.read_gpu(h200_nvml(), 0)
    assert (gpu.name, gpu.serial, gpu.pci_bus_id) == ("NVIDIA H200", "1654123456789", "00000000:18:00.0")
    assert (gpu.memory_bus_width_bits, gpu.max_memory_clock_mhz, gpu.max_sm_clock_mhz) == (6016, 3201, 1980)
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.pcie_gen_current, gpu.pcie_width_current) == (5, 16, 1, 16)
    assert gpu.nvlink_active == 18
    # NotSupported is "not applicable": no value, and no finding.
    assert gpu.retired_pages_pending is None and gpu.nvlink_speed_mbps == 0
    assert gpu.nvml_errors == {}
    assert gpu.pcie_gbps == pytest.approx(63.0, abs=0.05)


def test_inventory_reports_an_nvml_error_instead_of_swallowing_it():
    nvml = h200_nvml(nvmlDeviceGetMemoryBusWidth=Fails(pynvml.NVML_ERROR_NO_PERMISSION),
                     nvmlDeviceGetRemappedRows=Fails(pynvml.NVML_ERROR_GPU_IS_LOST))
    gpu = topology.read_gpu(nvml, 0)
    assert gpu.memory_bus_width_bits is None and gpu.remapped_rows_failed is None
    assert gpu.nvml_errors == {"memory bus width": "NVML error Insufficient Permissions",
                               "remapped rows": "NVML error GPU is lost"}


def test_nvlink_numbers_past_the_gpus_count_are_not_findings_but_a_failing_link_query_is():
    errors = {}
    assert topology.nvlinks_up(h200_nvml(), "h", errors) == list(range(18)) and errors == {}
    lost = h200_nvml(nvmlDeviceGetNvLinkState=lambda link: Fails(pynvml.NVML_ERROR_GPU_IS_LOST) if link == 3 else 1)
    assert 3 not in topology.nvlinks_up(lost, "h", errors)
    assert errors == {"NVLink 3 state": "NVML error GPU is lost"}


def test_a_field_value_that_fails_is_a_finding_and_not_supported_is_not():
    class Value:
        def __init__(self, ret):
            self.nvmlReturn, self.valueType, self.value = ret, 1, None

    errors = {}
    absent = h200_nvml(nvmlDeviceGetFieldValues=[Value(pynvml.NVML_ERROR_NOT_SUPPORTED)])
    assert topology._field(absent, "h", errors, 1) is None and errors == {}
    bad = topology._field(h200_nvml(nvmlDeviceGetFieldValues=[Value(pynvml.NVML_ERROR_TIMEOUT)]), "h", errors, 1)
    assert bad is None and errors == {"field 1": "NVML error Timeout"}


def test_a_bug_in_the_caller_is_not_taken_for_a_missing_feature():
    def broken(*args):
        raise TypeError("wrong arguments")

    with pytest.raises(TypeError):
        topology.read_gpu(h200_nvml(nvmlDeviceGetMemoryBusWidth=broken), 0)


def test_gpu_found_by_uuid_with_or_without_nvml_prefix():
    inventory = topology.Inventory("580.1", "13.0", [topology.read_gpu(h200_nvml(), 0)])
    assert topology.by_uuid(inventory, "8c1d7f3a-0000-4000-8000-000000000001").index == 0
    assert topology.by_uuid(inventory, "GPU-8c1d7f3a-0000-4000-8000-000000000001").index == 0
    assert topology.by_uuid(inventory, "GPU-ffffffff") is None
