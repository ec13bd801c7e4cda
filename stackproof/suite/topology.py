"""What the GPUs are and how they are linked, from NVML (nvidia-ml-py), and the bandwidth that topology
should sustain: the source of the default busbw pass threshold (no hand-written SKU table)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

GB = 1e9
# PCIe transfer rate per lane (GT/s) and line-code efficiency, by generation (PCI-SIG specifications).
PCIE_GTPS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
PCIE_EFFICIENCY = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}


@dataclasses.dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    nvlink_active: int = 0
    nvlink_speed_mbps: int = 0  # per link, per direction, as NVML reports it (MB/s)
    pcie_gen: int = 0
    pcie_width: int = 0
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_failed: bool | None = None

    @property
    def nvlink_gbps(self) -> float:
        """Peak unidirectional NVLink bandwidth of this GPU, GB/s."""
        return self.nvlink_active * self.nvlink_speed_mbps * 1e6 / GB

    @property
    def pcie_gbps(self) -> float:
        """Peak unidirectional PCIe bandwidth of this GPU's link, GB/s."""
        if self.pcie_gen not in PCIE_GTPS:
            return 0.0
        return PCIE_GTPS[self.pcie_gen] * self.pcie_width * PCIE_EFFICIENCY[self.pcie_gen] / 8


@dataclasses.dataclass
class Inventory:
    driver_version: str
    cuda_driver_version: str  # the newest CUDA this driver supports, e.g. "13.0"
    gpus: list[Gpu]


class NvmlUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def _nvml() -> Iterator[object]:
    try:
        import pynvml
    except ImportError as err:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML could not start: {err} (no NVIDIA driver visible here)") from err
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _optional(call, *args):
    """NVML answers NotSupported for fields a GPU lacks (ECC on consumer parts, NVLink on PCIe cards)."""
    try:
        return call(*args)
    except Exception:
        return None


def _field(nvml, handle, field_id: int, scope: int | None = None) -> int | None:
    """One NVML field value as an int, whatever its value type; None when the GPU does not report it."""
    request = [(field_id, scope)] if scope is not None else [field_id]
    values = _optional(nvml.nvmlDeviceGetFieldValues, handle, request)
    if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
        return None
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    return int(getattr(values[0].value, member.get(values[0].valueType, "uiVal")))


def _nvlink_speed_mbps(nvml, handle) -> int:
    """Per-link NVLink speed (MB/s): the common speed of active links, else link 0's."""
    for field_id, scope in ((nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, None),
                            (getattr(nvml, "NVML_FI_DEV_NVLINK_GET_SPEED", None), 0),
                            (nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_L0, None)):
        if field_id is not None:
            speed = _field(nvml, handle, field_id, scope)
            if speed:
                return speed
    return 0


def _gpu(nvml, index: int) -> Gpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    gpu = Gpu(index=index, name=nvml.nvmlDeviceGetName(handle), uuid=nvml.nvmlDeviceGetUUID(handle),
              memory_total_bytes=nvml.nvmlDeviceGetMemoryInfo(handle).total)
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        if _optional(nvml.nvmlDeviceGetNvLinkState, handle, link) == nvml.NVML_FEATURE_ENABLED:
            gpu.nvlink_active += 1
    if gpu.nvlink_active:
        gpu.nvlink_speed_mbps = _nvlink_speed_mbps(nvml, handle)
    gpu.pcie_gen = _optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle) or 0
    gpu.pcie_width = _optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle) or 0
    gpu.ecc_uncorrected_volatile = _optional(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                             nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    pending = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    gpu.retired_pages_pending = None if pending is None else bool(pending)
    remapped = _optional(nvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failure)
    gpu.remapped_rows_failed = None if remapped is None else bool(remapped[3])
    return gpu


def inventory() -> Inventory:
    """Every GPU NVML can see (a container sees only the GPUs it was given). Raises NvmlUnavailable."""
    with _nvml() as nvml:
        cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
        return Inventory(driver_version=str(nvml.nvmlSystemGetDriverVersion()),
                         cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
                         gpus=[_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())])


def visible(inv: Inventory, cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible (indices or UUID prefixes), in CUDA's order."""
    if cuda_visible_devices is None:
        return list(inv.gpus)
    chosen = []
    for entry in filter(None, (e.strip() for e in cuda_visible_devices.split(","))):
        if entry.isdigit():
            match = [g for g in inv.gpus if g.index == int(entry)]
        else:
            match = [g for g in inv.gpus if g.uuid.startswith(entry) or g.uuid == f"GPU-{entry}"]
        if not match:
            break  # CUDA stops at the first entry it cannot resolve
        chosen.append(match[0])
    return chosen


@dataclasses.dataclass(frozen=True)
class Threshold:
    gbps: float | None
    source: str


def busbw_threshold(gpus: list[Gpu], num_nodes: int, fraction: float, override: float | None) -> Threshold:
    """The busbw the largest all_reduce must reach: `override` if given, else `fraction` of the slowest GPU's
    peak link bandwidth (NVLink when its links are up, else PCIe). Across nodes the network bounds it and NVML
    cannot see the network, so no threshold is derived there."""
    if override is not None:
        return Threshold(override, "--min-busbw")
    if num_nodes > 1:
        return Threshold(None, "not derived across nodes (NVML cannot see the network): pass --min-busbw")
    if not gpus:
        return Threshold(None, "not derived: NVML sees no GPU")
    links = []
    for gpu in gpus:
        if gpu.nvlink_active and gpu.nvlink_speed_mbps:
            links.append((gpu.nvlink_gbps, f"NVLink {gpu.nvlink_active} links x {gpu.nvlink_speed_mbps} MB/s"))
        elif gpu.pcie_gbps:
            links.append((gpu.pcie_gbps, f"PCIe gen{gpu.pcie_gen} x{gpu.pcie_width}"))
    if len(links) < len(gpus):
        return Threshold(None, "not derived: NVML reports neither NVLink nor PCIe speed; pass --min-busbw")
    peak, link = min(links)
    return Threshold(round(fraction * peak, 1), f"{fraction:g} x {peak:.1f} GB/s peak ({link})")


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
