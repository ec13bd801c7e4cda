"""The bars a figure is held to, from what the hardware should have, never from its current, possibly degraded
state: NVLinks the GPU supports (and its node peers have), PCIe at the GPU's own max generation and width, memory
bus width and max clocks. A bar that cannot be derived is None with the reason (the check then skips, never
passes without a bar)."""

from __future__ import annotations

import dataclasses

from stackproof.judge.readings import Gpu, PairReading

GB = 1e9
# PCIe transfer rate per lane (GT/s) and line-code efficiency, by generation (PCI-SIG specifications).
PCIE_GTPS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
PCIE_EFFICIENCY = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}

# Dense tensor-core FLOP per clock per SM for bf16 inputs (fp32 accumulate), by compute capability, from NVIDIA's
# architecture whitepapers: A100 312 TFLOP/s = 108 SMs x 1410 MHz x 2048; H100 SXM 989.4 TFLOP/s = 132 SMs x
# 1830 MHz x 4096; L40S 362 TFLOP/s = 142 SMs x 2520 MHz x 1024 (sm_86 likewise, at fp32 accumulate on the
# professional parts). Architectures after Hopper are left out until a whitepaper gives their per-SM rate: they
# get no bar, and the GEMM check skips saying so (the median check across the job still runs).
DENSE_BF16_FLOP_PER_CLOCK_PER_SM = {(8, 0): 2048, (8, 6): 1024, (8, 9): 1024, (9, 0): 4096}
# nvmlDeviceGetTopologyCommonAncestor's levels, in nvidia-smi topo -m's words.
PCIE_PATHS = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


@dataclasses.dataclass(frozen=True)
class Bar:
    value: float | None  # None: no bar could be derived (source says why)
    source: str


# --- Peaks ---------------------------------------------------------------------------------------------------------

def pcie_peak_gbps(gen: int | None, width: int | None) -> float:
    """Peak unidirectional bandwidth of a PCIe link, GB/s (0 for an unknown generation or width).
    Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s."""
    if gen not in PCIE_GTPS or not width:
        return 0.0
    return PCIE_GTPS[gen] * width * PCIE_EFFICIENCY[gen] / 8


def hbm_peak_bytes_per_s(bus_width_bits: int, mem_clock_mhz: int) -> float:
    """Peak device-memory bandwidth: bus width in bytes x max memory clock x 2 (double data rate).
    H200: 6016 bit / 8 x 3201 MHz x 2 = 4.81 TB/s (a device copy reaches about 4.25 TB/s counting read + write)."""
    return bus_width_bits / 8 * mem_clock_mhz * 1e6 * 2


def gemm_peak_flops(sm_count: int, sm_clock_mhz: int, compute_capability: tuple[int, int]) -> float | None:
    """Peak dense bf16 tensor-core FLOP/s: SMs x max SM clock x FLOP/clock/SM of the architecture; None for an
    architecture without a known rate. H200: 132 x 1980 MHz x 4096 = 1070 TFLOP/s (8192^3 reaches 726-799)."""
    per_sm = DENSE_BF16_FLOP_PER_CLOCK_PER_SM.get(tuple(compute_capability))
    return None if per_sm is None else sm_count * sm_clock_mhz * 1e6 * per_sm


# --- What the hardware should have ---------------------------------------------------------------------------------

def pcie_expected(gpu: Gpu) -> tuple[int, int]:
    """(generation, width) the GPU's link should train to: the GPU's own max generation (NVML's
    GpuMaxPcieLinkGeneration) and its own max width (its PCIe capability, LnkCap, read from sysfs), each falling
    back to what NVML says the GPU and slot together allow when the GPU's own value is not readable."""
    return (gpu.pcie_gen_gpu_max or gpu.pcie_gen or 0), (gpu.pcie_width_gpu_max or gpu.pcie_width or 0)


def nvlinks_expected(gpu: Gpu, peers: list[Gpu]) -> int:
    """The NVLinks this GPU should have up: every link it has (up or down), and no fewer than the most its node
    peers of the same model have."""
    same_model = [p.nvlink_supported or 0 for p in peers if p.name == gpu.name]
    return max([gpu.nvlink_supported or gpu.nvlink_active, *same_model])


def nvlink_speed_expected(gpu: Gpu, peers: list[Gpu]) -> int:
    """Per-link speed (MB/s): this GPU's, else (none of its links up) its same-model peers'."""
    return gpu.nvlink_speed_mbps or max([p.nvlink_speed_mbps for p in peers if p.name == gpu.name] or [0])


def link_capacity(gpu: Gpu, peers: list[Gpu]) -> tuple[float, str]:
    """(GB/s, label) of the GPU's expected peak link bandwidth: NVLink when it has links, else PCIe."""
    links, speed = nvlinks_expected(gpu, peers), nvlink_speed_expected(gpu, peers)
    if links and speed:
        return links * speed * 1e6 / GB, f"NVLink {links} links x {speed} MB/s"
    gen, width = pcie_expected(gpu)
    return pcie_peak_gbps(gen, width), f"PCIe gen{gen} x{width}"


# --- Bars ------------------------------------------------------------------------------------------------------------

BUSBW_FIX = ("busbw below the topology's bar: check NVLink/PCIe state (nvidia-smi topo -m), NCCL_P2P_DISABLE, "
             "NCCL_IB_*; or set the bar with --min-busbw")


def busbw_bar(gpus: list[Gpu], num_nodes: int, fraction: float, override: float | None,
              across: Bar | None = None) -> Bar:
    """The busbw the largest all_reduce must reach: `override` if given, else `fraction` of the slowest GPU's
    expected peak link bandwidth. Across nodes the network bounds it: `across`, the bar from the NICs' line rate
    (judge/fabric.py cross_node_busbw_bar), which says why where it could not be derived."""
    if override is not None:
        return Bar(override, "--min-busbw")
    if num_nodes > 1:
        return across or Bar(None, "not derived across nodes: no NIC facts; pass --min-busbw")
    if not gpus:
        return Bar(None, "not derived: NVML sees no GPU")
    links = [link_capacity(gpu, gpus) for gpu in gpus]
    if not all(gbps for gbps, _ in links):
        return Bar(None, "not derived: NVML reports neither NVLink nor PCIe speed; pass --min-busbw")
    peak, link = min(links)
    return Bar(round(fraction * peak, 1), f"{fraction:g} x {peak:.1f} GB/s peak ({link})")


def nvlink_pair_gbps(links: int, speed_mbps: int) -> float:
    return links * speed_mbps * 1e6 / GB


@dataclasses.dataclass(frozen=True)
class PairLink:
    kind: str  # NVLink | PCIe | unknown
    gbps: float  # peak per direction; 0.0 when unknown
    label: str  # "NVLink 18 links x 26562 MB/s", "PCIe gen5 x16 (PHB)"


def pair_link(pair: PairReading) -> PairLink:
    """The link the pair of GPUs should have: NVLink when NVML says the pair can talk over it (the links a has
    to b, up or down; through an NVSwitch every link the weaker GPU has), else PCIe at the slower GPU's own max
    generation and width, with the path between them. Links counted from what the GPUs have, not what is up now:
    a link down lowers the pair's figure, never its bar."""
    a, b = pair.a, pair.b
    speed = min(a.nvlink_speed_mbps, b.nvlink_speed_mbps)
    if pair.nvlink_p2p_ok and speed:
        links = pair.nvlinks_to_peer or min(a.nvlink_supported or a.nvlink_active,
                                            b.nvlink_supported or b.nvlink_active)
        return PairLink("NVLink", nvlink_pair_gbps(links, speed), f"NVLink {links} links x {speed} MB/s")
    gen, width = min((pcie_expected(a), pcie_expected(b)), key=lambda link: pcie_peak_gbps(*link))
    peak = pcie_peak_gbps(gen, width)
    if not peak:
        return PairLink("unknown", 0.0, "link unknown: NVML reports neither NVLink nor PCIe speed")
    level = pair.common_ancestor
    path = f" ({PCIE_PATHS.get(level, level)})" if level is not None else ""
    return PairLink("PCIe", peak, f"PCIe gen{gen} x{width}{path}")


def hbm_bar(gpu: Gpu, fraction: float) -> Bar:
    if not gpu.memory_bus_width_bits or not gpu.max_memory_clock_mhz:
        return Bar(None, "not derived: NVML reports no memory bus width or max memory clock")
    peak = hbm_peak_bytes_per_s(gpu.memory_bus_width_bits, gpu.max_memory_clock_mhz)
    return Bar(fraction * peak, f"{fraction:g} x {peak / 1e12:.2f} TB/s peak ({gpu.memory_bus_width_bits} bit x "
                                f"{gpu.max_memory_clock_mhz} MHz x 2)")


def pcie_bar(gpu: Gpu, fraction: float) -> Bar:
    gen, width = pcie_expected(gpu)
    peak = pcie_peak_gbps(gen, width) * GB
    if not peak:
        return Bar(None, "not derived: neither NVML nor sysfs reports the GPU's PCIe generation and width")
    return Bar(fraction * peak, f"{fraction:g} x {peak / 1e9:.1f} GB/s peak (PCIe gen{gen} x{width}, the GPU's own "
                                "max)")


def gemm_bar(sm_count: int, sm_clock_mhz: int | None, compute_capability: tuple[int, int], fraction: float) -> Bar:
    major, minor = compute_capability
    if not sm_clock_mhz:
        return Bar(None, "not derived: NVML reports no max SM clock")
    peak = gemm_peak_flops(sm_count, sm_clock_mhz, compute_capability)
    if peak is None:
        return Bar(None, f"not derived: no dense bf16 FLOP/clock/SM known for sm_{major}{minor} (no NVIDIA "
                         "whitepaper figure in stackproof/judge/bars.py)")
    per_sm = DENSE_BF16_FLOP_PER_CLOCK_PER_SM[(major, minor)]
    return Bar(fraction * peak, f"{fraction:g} x {peak / 1e12:.0f} TFLOP/s peak ({sm_count} SMs x {sm_clock_mhz} MHz x "
                                f"{per_sm} FLOP/clock/SM, sm_{major}{minor})")
