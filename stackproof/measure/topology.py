"""What the GPUs are and how they are linked, from NVML (nvidia-ml-py) and the PCI bus (sysfs): the facts the
bars and expectations of stackproof/judge/ are derived from (no hand-written SKU table). Facts only: no bar is
read or derived here (tests/test_layers.py holds the measurement away from judge/bars.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from stackproof import environment
from stackproof.judge.readings import Gpu, PairReading

# Where the PCI bus lists its functions (sysfs); a container that mounts the host's sysfs elsewhere, or a test,
# passes another root (validate --pci-devices).
PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # PCI class 03: VGA-compatible (00) and 3D (02) controllers
# The launcher's survey of the GPUs takes well under a second on 8 GPUs; NVML not answering in this long is
# stuck, not slow.
SURVEY_DEADLINE_S = 10.0


@dataclasses.dataclass
class Inventory:
    driver_version: str
    cuda_driver_version: str  # the newest CUDA this driver supports, e.g. "13.0"
    gpus: list[Gpu]
    # GPUs NVML counts but cannot reach (GPU lost, Unknown Error): {NVML index: "NVML error <text>"}.
    unreachable: dict[int, str] = dataclasses.field(default_factory=dict)
    stalled: str = ""  # NVML did not answer within the survey's deadline (then no GPU is listed)


class NvmlUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def nvml_session() -> Iterator[object]:
    """The pynvml module, initialised for the duration of the block. Raises NvmlUnavailable."""
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


def optional(nvml, errors: dict[str, str], what: str, call, *args):
    """`call(*args)`, or None where NVML answers NotSupported: the GPU lacks the feature (ECC on consumer parts,
    NVLink on PCIe cards, retired pages on GPUs that remap rows), which is not a fault. Any other NVML error
    (no permission, GPU lost, timeout, ...) is recorded in `errors` under `what`, to be reported as a finding."""
    try:
        return call(*args)
    except nvml.NVMLError_NotSupported:
        return None
    except nvml.NVMLError as err:
        errors[what] = f"NVML error {err}"
        return None


def _field(nvml, handle, errors: dict[str, str], field_id: int, scope: int | None = None) -> int | None:
    """One NVML field value as an int, whatever its value type; None when the GPU does not report it."""
    request = [(field_id, scope)] if scope is not None else [field_id]
    values = optional(nvml, errors, f"field {field_id}", nvml.nvmlDeviceGetFieldValues, handle, request)
    if not values or values[0].nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED:
        return None
    if values[0].nvmlReturn != nvml.NVML_SUCCESS:
        errors[f"field {field_id}"] = f"NVML error {nvml.NVMLError(values[0].nvmlReturn)}"
        return None
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    return int(getattr(values[0].value, member.get(values[0].valueType, "uiVal")))


def _nvlink_speed_mbps(nvml, handle, errors: dict[str, str]) -> int:
    """Per-link NVLink speed (MB/s): the common speed of active links, else link 0's."""
    for field_id, scope in ((nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, None),
                            (getattr(nvml, "NVML_FI_DEV_NVLINK_GET_SPEED", None), 0),
                            (nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_L0, None)):
        if field_id is not None:
            speed = _field(nvml, handle, errors, field_id, scope)
            if speed:
                return speed
    return 0


def nvlink_states(nvml, handle, errors: dict[str, str]) -> dict[int, bool]:
    """{link number: up} for every NVLink the GPU has. NVML_NVLINK_MAX_LINKS is the most any GPU has; NVML
    answers InvalidArgument (or NotSupported) for a link number this GPU does not have: no such link, not a
    fault. A link the GPU has answers its state, up or down."""
    states = {}
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        except nvml.NVMLError as err:
            errors[f"NVLink {link} state"] = f"NVML error {err}"
            states[link] = False
            continue
        states[link] = state == nvml.NVML_FEATURE_ENABLED
    return states


def nvlink_far_end(nvml, handle, link: int) -> str | None:
    """The PCI bus id of what this NVLink is wired to (a GPU, an NVSwitch), or None where NVML names none (no
    answer, or an all-zero address): an unwired slot. Any NVML error here means "not known to be wired", not a
    fault of the GPU: the slot's state was read already."""
    try:
        remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
    except nvml.NVMLError:
        return None
    bus_id = _text(getattr(remote, "busId", None)) or ""
    return bus_id if bus_id.strip("0:.") else None


def nvlinks_up(nvml, handle, errors: dict[str, str]) -> list[int]:
    """The NVLinks that are up, by link number."""
    return [link for link, up in nvlink_states(nvml, handle, errors).items() if up]


def sysfs_name(pci_bus_id: str) -> str:
    """NVML's bus id ("00000000:18:00.0") as sysfs names the function ("0000:18:00.0")."""
    domain, rest = pci_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _sysfs_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pcie_width_capability(pci_bus_id: str | None, pci_root: str = PCI_DEVICES) -> int | None:
    """The GPU's own max link width, from its PCIe capability (LnkCap, sysfs max_link_width). NVML's
    MaxPcieLinkWidth is what the GPU and its slot allow together, so a x16 GPU in a x8 slot would read x8 there
    and the shortfall would never show; LnkCap is the GPU's. None where sysfs does not show it."""
    if not pci_bus_id:
        return None
    return _sysfs_int(Path(pci_root) / sysfs_name(pci_bus_id) / "max_link_width")


def local_cpus(pci_bus_id: str | None, pci_root: str = PCI_DEVICES) -> set[int] | None:
    """The CPUs of the GPU's own NUMA node (sysfs local_cpulist, e.g. "0-15,32-47"); None where sysfs does not
    say or none of them is this process's to run on."""
    if not pci_bus_id:
        return None
    try:
        text = (Path(pci_root) / sysfs_name(pci_bus_id) / "local_cpulist").read_text().strip()
        cpus = set()
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except (OSError, ValueError):
        return None
    return (cpus & os.sched_getaffinity(0)) or None


@contextlib.contextmanager
def near(pci_bus_id: str | None, pci_root: str = PCI_DEVICES) -> Iterator[set[int] | None]:
    """This thread runs on the GPU's NUMA node inside the block (so pinned memory it allocates is the GPU's
    local memory, as a launcher with NUMA binding gives a training rank), then where it ran before."""
    cpus, before = local_cpus(pci_bus_id, pci_root), os.sched_getaffinity(0)
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
    except OSError:  # a cgroup that changed under us: measure where the thread runs, as without sysfs
        cpus = None
    try:
        yield cpus
    finally:
        if cpus:
            os.sched_setaffinity(0, before)


def missing_from_nvml(bus: list[str], inventory: Inventory | None) -> list[str]:
    """The bus's NVIDIA GPUs that NVML does not show (all of them when NVML cannot answer)."""
    shown = {sysfs_name(g.pci_bus_id) for g in (inventory.gpus if inventory else []) if g.pci_bus_id}
    return [address for address in bus if address not in shown]


def nvidia_gpus_on_bus(pci_root: str = PCI_DEVICES) -> list[str] | None:
    """The PCI addresses of the NVIDIA display and 3D controllers on the bus (sysfs); None when no PCI bus is
    visible here (a container without /sys, or a machine without PCI)."""
    root = Path(pci_root)
    try:
        functions = sorted(root.iterdir())
    except OSError:
        return None
    found = []
    for function in functions:
        try:
            vendor = (function / "vendor").read_text().strip()
            klass = (function / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass.startswith(GPU_CLASSES):
            found.append(function.name)
    return found


def _text(value: str | bytes | None) -> str | None:
    """Older nvidia-ml-py releases hand back bytes for strings."""
    return value.decode() if isinstance(value, bytes) else value


def read_gpu(nvml, index: int, pci_root: str = PCI_DEVICES) -> Gpu:
    """One GPU as NVML (and sysfs, for its own PCIe width) describes it, by NVML index (the handle lookups that
    must work are not optional: they raise NVMLError)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    found = Gpu(index=index, name=_text(nvml.nvmlDeviceGetName(handle)), uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                memory_total_bytes=nvml.nvmlDeviceGetMemoryInfo(handle).total)
    errors = found.nvml_errors

    def ask(what, call, *args):
        return optional(nvml, errors, what, call, handle, *args)

    found.serial = _text(ask("serial", nvml.nvmlDeviceGetSerial))
    pci = ask("PCI info", nvml.nvmlDeviceGetPciInfo)
    found.pci_bus_id = None if pci is None else _text(pci.busId)
    links = nvlink_states(nvml, handle, errors)
    found.nvlink_active = sum(links.values())
    found.nvlinks_up = [link for link, up in links.items() if up]
    down = [link for link, up in links.items() if not up]
    found.nvlinks_down = [link for link in down if nvlink_far_end(nvml, handle, link)]
    found.nvlinks_unwired = [link for link in down if link not in found.nvlinks_down]
    found.nvlink_supported = len(links) - len(found.nvlinks_unwired)
    if found.nvlink_active:
        found.nvlink_speed_mbps = _nvlink_speed_mbps(nvml, handle, errors)
    found.pcie_gen = ask("max PCIe generation", nvml.nvmlDeviceGetMaxPcieLinkGeneration) or 0
    found.pcie_width = ask("max PCIe width", nvml.nvmlDeviceGetMaxPcieLinkWidth) or 0
    found.pcie_gen_current = ask("current PCIe generation", nvml.nvmlDeviceGetCurrPcieLinkGeneration)
    found.pcie_width_current = ask("current PCIe width", nvml.nvmlDeviceGetCurrPcieLinkWidth)
    found.memory_bus_width_bits = ask("memory bus width", nvml.nvmlDeviceGetMemoryBusWidth)
    found.max_memory_clock_mhz = ask("max memory clock", nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_MEM)
    found.max_sm_clock_mhz = ask("max SM clock", nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM)
    found.vbios_version = _text(ask("VBIOS version", nvml.nvmlDeviceGetVbiosVersion))
    ecc = ask("ECC mode", nvml.nvmlDeviceGetEccMode)  # (current, pending)
    found.ecc_enabled = None if ecc is None else bool(ecc[0])
    persistence = ask("persistence mode", nvml.nvmlDeviceGetPersistenceMode)
    found.persistence_mode = None if persistence is None else bool(persistence)
    mig = ask("MIG mode", nvml.nvmlDeviceGetMigMode)  # (current, pending)
    found.mig_enabled = None if mig is None else bool(mig[0])
    power = ask("enforced power limit", nvml.nvmlDeviceGetEnforcedPowerLimit)  # mW
    found.power_limit_w = None if power is None else power / 1000
    found.pcie_gen_gpu_max = ask("GPU max PCIe generation", nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration)
    found.pcie_width_gpu_max = pcie_width_capability(found.pci_bus_id, pci_root)
    return found


def inventory(pci_root: str = PCI_DEVICES) -> Inventory:
    """Every GPU NVML can see (a container sees only the GPUs it was given); a GPU NVML counts but cannot reach
    is in `unreachable`, never a traceback. Raises NvmlUnavailable."""
    with nvml_session() as nvml:
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
            driver, count = str(_text(nvml.nvmlSystemGetDriverVersion())), nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML started but cannot count the GPUs: {err}") from err
        found = Inventory(driver_version=driver, cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}", gpus=[])
        for index in range(count):
            try:
                found.gpus.append(read_gpu(nvml, index, pci_root))
            except nvml.NVMLError as err:
                found.unreachable[index] = f"NVML error {err}"
        return found


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


def by_uuid(inv: Inventory, uuid: str) -> Gpu | None:
    """The GPU with this UUID, with or without NVML's "GPU-" prefix (torch prints it without)."""
    want = uuid.removeprefix("GPU-")
    return next((g for g in inv.gpus if g.uuid.removeprefix("GPU-") == want), None)


def cuda_visible_devices() -> str | None:
    return environment.CUDA_VISIBLE_DEVICES.get()


def survey(pci_root: str = PCI_DEVICES, deadline_s: float = SURVEY_DEADLINE_S) -> Inventory | None:
    """The node's GPUs as NVML sees them (no CUDA context, no torch import: the launcher's start-up stays short);
    None when NVML cannot answer at all. NVML is asked from a thread of its own, for at most `deadline_s`: an
    NVML call stuck in the driver (a GPU hung after an XID) leaves that thread behind, and the survey answers an
    Inventory with no GPU whose `stalled` says so, so the run goes on to a verdict."""
    answers: dict[str, object] = {}

    def ask() -> None:
        try:
            answers["inventory"] = inventory(pci_root)
        except NvmlUnavailable:
            answers["inventory"] = None
        except BaseException as err:  # raised where the caller waits, not lost in the thread
            answers["error"] = err

    worker = threading.Thread(target=ask, name="nvml-survey", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        return Inventory("n/a", "n/a", [], stalled=f"NVML did not answer within {deadline_s:g} s (nvmlInit, the GPU "
                                                   "count or a GPU's reading hangs in the driver)")
    if "error" in answers:
        raise answers["error"]  # type: ignore[misc]
    return answers["inventory"]  # type: ignore[return-value]


def pair_reading(nvml, a: Gpu, b: Gpu) -> PairReading:
    """How NVML says the pair of GPUs of this node is linked, by NVML index: whether they can talk over NVLink,
    the links a has to b's PCI bus id (up or down: wired), and the PCIe path between them."""
    errors: dict[str, str] = {}
    first, second = nvml.nvmlDeviceGetHandleByIndex(a.index), nvml.nvmlDeviceGetHandleByIndex(b.index)
    status = optional(nvml, errors, "P2P NVLink status", nvml.nvmlDeviceGetP2PStatus, first, second,
                      nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    p2p_ok = status == nvml.NVML_P2P_STATUS_OK
    direct = 0
    if p2p_ok:
        for link in nvlink_states(nvml, first, errors):
            remote = optional(nvml, errors, f"NVLink {link} remote", nvml.nvmlDeviceGetNvLinkRemotePciInfo, first,
                              link)
            direct += remote is not None and _text(remote.busId) == b.pci_bus_id
    level = optional(nvml, errors, "common ancestor", nvml.nvmlDeviceGetTopologyCommonAncestor, first, second)
    return PairReading(a, b, p2p_ok, direct, level)


def pair_readings(gpus: list[Gpu]) -> dict[tuple[int, int], PairReading]:
    """Every pair of these GPUs (positions in the list, i < j: CUDA's order) and how it is linked. Raises
    NvmlUnavailable."""
    with nvml_session() as nvml:
        return {(i, j): pair_reading(nvml, gpus[i], gpus[j])
                for i in range(len(gpus)) for j in range(i + 1, len(gpus))}
