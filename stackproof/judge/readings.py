"""The typed readings the judge reads, measured by stackproof/measure/: what a GPU is and how a pair is linked
(measure/topology.py, from NVML and sysfs) and whether CUDA reaches the GPUs (measure/cuda_reach.py). Plain data,
here so that the judge's rules and the measurements share them without the judge importing a measurement."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    serial: str | None = None  # the board's serial number (what an RMA asks for)
    pci_bus_id: str | None = None  # e.g. "00000000:18:00.0"
    nvlink_active: int = 0
    nvlink_speed_mbps: int = 0  # per link, per direction, as NVML reports it (MB/s)
    # The most the link can train to with this GPU in this system, and what it runs at now. An idle GPU drops
    # the generation to save power, so a current generation below the max means nothing unless read under load.
    pcie_gen: int = 0
    pcie_width: int = 0
    pcie_gen_current: int | None = None
    pcie_width_current: int | None = None
    memory_bus_width_bits: int | None = None
    max_memory_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    # What the board is and how it is set up (a node spec compares these; None: NVML does not report it).
    vbios_version: str | None = None
    ecc_enabled: bool | None = None  # current ECC mode
    persistence_mode: bool | None = None
    mig_enabled: bool | None = None  # current MIG mode
    power_limit_w: float | None = None  # the enforced power limit
    # What the GPU itself supports, whatever the slot or its links do now: the expectation, not the state.
    # A link slot counts as the GPU's only when wired: up, or down with a far end NVML names (its remote PCI info).
    # A PCIe card without an NVLink bridge answers DISABLED for every slot it has: none of them is wired.
    nvlink_supported: int | None = None  # NVLinks the GPU has, wired (up or not); 0: none (a PCIe card)
    nvlinks_down: list[int] = dataclasses.field(default_factory=list)  # wired links that are not up
    nvlinks_up: list[int] = dataclasses.field(default_factory=list)
    # Slots down with no far end NVML names: no link, unless the node's other GPUs of this model have it up
    # (judge/hardware.py decides).
    nvlinks_unwired: list[int] = dataclasses.field(default_factory=list)
    pcie_gen_gpu_max: int | None = None  # the GPU's own max PCIe generation (pcie_gen is the system's)
    pcie_width_gpu_max: int | None = None  # the GPU's own max width, its LnkCap (pcie_width is the system's)
    # NVML calls that failed with anything but NotSupported: {what was asked: "NVML error <text>"}. Each one is
    # a finding, never a silent pass (the field it was for stays None).
    nvml_errors: dict[str, str] = dataclasses.field(default_factory=dict)



@dataclasses.dataclass(frozen=True)
class PairReading:
    """How two GPUs of a node are linked, as NVML answers (measure/topology.py pair_reading): facts only. The
    pair's peak and its words are the judge's (judge/bars.py pair_link)."""

    a: Gpu  # each GPU's NVLink counts and per-link speed, and its PCIe generation and width, are on its reading
    b: Gpu
    nvlink_p2p_ok: bool  # NVML's P2P status over NVLink is OK for a -> b
    nvlinks_to_peer: int  # a's links (up or down) whose far end is b's PCI bus id; 0 through an NVSwitch
    common_ancestor: int | None  # nvmlDeviceGetTopologyCommonAncestor's level (10 PIX ... 50 SYS); None: not said

@dataclasses.dataclass(frozen=True)
class Reach:
    nvml_error: int | None = None  # NVML's error code at start-up (None: it started, or nvidia-ml-py is missing)
    nvml_words: str = ""  # what NVML (or its absence) said
    nvml_gpus: int | None = None  # GPUs NVML counts (None: NVML did not start)
    cuda_error: int | None = None  # cuInit's CUresult (0: success; None: libcuda.so.1 not loadable; -1: hung)
    cuda_words: str = ""  # its name (CUDA_ERROR_NO_DEVICE), or why libcuda.so.1 is not there
    cuda_gpus: int | None = None  # cuDeviceGetCount after a successful cuInit (CUDA_VISIBLE_DEVICES unset)
    torch_version: str | None = None  # None: no torch installed
    torch_cuda: str | None = None  # the CUDA torch was built for; None: a CPU-only build
    device_files: tuple[str, ...] = ()  # /dev/nvidia0, /dev/nvidia1, ...: what the container was given
    cuda_visible_devices: str | None = None
