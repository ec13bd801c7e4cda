"""Expected vs found for the hardware itself: what each GPU should have (its own NVLinks and PCIe capability,
and what its same-model peers on the node have: links, memory, max clocks) against what it has now. Pure
functions of topology.Gpu facts; the findings name the GPU."""

from __future__ import annotations

from stackproof.judge.bars import nvlinks_expected, pcie_expected
from stackproof.judge.findings import RESET, RMA, Finding, lost_gpu_fix
from stackproof.judge.readings import Gpu

RESEAT = "reseat the GPU / riser and check the slot and its BIOS link settings (lspci -vv: LnkSta vs LnkCap)"
NVLINK_FIX = ("check the fabric (nvidia-smi nvlink -s; fabric manager on NVSwitch systems), reset the GPU; a link "
              "that stays down: " + RMA)


def _same_model(gpu: Gpu, peers: list[Gpu]) -> list[Gpu]:
    return [p for p in peers if p.name == gpu.name and p.uuid != gpu.uuid]


def nvlinks_down(gpu: Gpu, same_model: list[Gpu]) -> list[int]:
    """The GPU's links that should be up and are not: its wired links down, and the slots NVML names no far end
    for that the node's other GPUs of this model have up (their link N up: this GPU's link N is one it has). A
    PCIe card without a bridge, on a node of such cards, has none (cf. NVIDIA/NVSentinel#1481, DCGM#49)."""
    up_on_peers = {link for peer in same_model for link in peer.nvlinks_up}
    return sorted(set(gpu.nvlinks_down) | (set(gpu.nvlinks_unwired) & up_on_peers))


def findings(gpu: Gpu, peers: list[Gpu]) -> list[Finding]:
    """What this GPU lacks of what it should have. `peers`: the node's GPUs NVML sees (this one may be among)."""
    found: list[Finding] = []

    def finding(check, expected, what, category, severity, action):
        found.append(Finding(gpu.index, gpu.uuid, check, expected, what, category, severity, action))

    same_model = _same_model(gpu, peers)
    down = nvlinks_down(gpu, same_model)
    if down:
        finding("NVLink down", f"all {len(gpu.nvlinks_up) + len(down)} NVLinks of the GPU up",
                f"link(s) {', '.join(map(str, down))} down ({gpu.nvlink_active} up)", "interconnect",
                "reset", NVLINK_FIX)
    expected_links = nvlinks_expected(gpu, same_model)
    if gpu.nvlink_supported is not None and gpu.nvlink_supported + len(down) - len(gpu.nvlinks_down) < expected_links:
        finding("NVLinks present", f"{expected_links} NVLinks, as the node's other {gpu.name} GPUs have",
                f"{gpu.nvlink_supported}", "interconnect", "isolate", NVLINK_FIX)

    gen, width = pcie_expected(gpu)
    if gen and gpu.pcie_gen and gpu.pcie_gen < gen:
        finding("PCIe generation allowed", f"gen{gen} (the GPU's own max)",
                f"gen{gpu.pcie_gen} at most in this slot/system", "interconnect", "triage", RESEAT)
    # At rest only the width is judged: an idle link lowers its generation to save power (judged under load).
    if width and gpu.pcie_width_current is not None and gpu.pcie_width_current < width:
        finding("PCIe link width", f"x{width} (the GPU's own max)", f"x{gpu.pcie_width_current} (downtrained)",
                "interconnect", "triage", RESEAT)

    most_memory = max([p.memory_total_bytes for p in same_model], default=0)
    if gpu.memory_total_bytes < most_memory:
        finding("memory size", f"{most_memory} bytes, as the node's other {gpu.name} GPUs have",
                f"{gpu.memory_total_bytes} bytes", "gpu-hardware", "reset", RESET)
    for what, attribute in (("max SM clock", "max_sm_clock_mhz"), ("max memory clock", "max_memory_clock_mhz")):
        fastest = max([getattr(p, attribute) or 0 for p in same_model], default=0)
        mine = getattr(gpu, attribute)
        if mine is not None and mine < fastest:
            finding(what, f"{fastest} MHz, as the node's other {gpu.name} GPUs have", f"{mine} MHz", "gpu-hardware",
                    "triage", "compare nvidia-smi -q -d CLOCK with the other GPUs (a clock cap, or another VBIOS)")
    return found


def pcie_under_load(gpu: Gpu, gen_now: int | None, width_now: int | None) -> Finding | None:
    """The PCIe link as read while a copy runs over it: then the generation too must be the GPU's own max."""
    gen, width = pcie_expected(gpu)
    if gen_now is None or width_now is None or not gen:
        return None
    if gen_now >= gen and width_now >= width:
        return None
    return Finding(gpu.index, gpu.uuid, "PCIe link under load", f"gen{gen} x{width} (the GPU's own max)",
                   f"gen{gen_now} x{width_now} while copying (downtrained)", "interconnect", "triage", RESEAT)


def unreachable(index: int, error: str) -> Finding:
    """A GPU NVML counts but cannot reach."""
    return Finding(index, "n/a", "GPU reachable", "an answer from NVML for the GPU", f"n/a: {error}",
                   "gpu-hardware", "isolate",
                   "the GPU fell off the bus or its driver state is broken (NVML's Unknown Error / GPU is lost): "
                   "drain the node, look for Xid 79 in the kernel log, reboot; if it recurs, " + RMA)


def missing_from_the_bus(addresses: list[str], nvml_sees: int) -> list[Finding]:
    """NVIDIA GPUs on the PCI bus that NVML does not show (fell off the bus, or the driver did not bind)."""
    return [Finding(None, "n/a", "GPU on the PCI bus", f"the GPU at PCI {address} visible to NVML",
                    f"on the bus, not among the {nvml_sees} GPU(s) NVML shows", "gpu-hardware", "isolate",
                    lost_gpu_fix(" on this address")) for address in addresses]


GPU_HANG = ("gpu-hardware", "reset")  # the watchdog's stall of one rank that drives a GPU


def unkillable(rank: int, pid: int, state: str, wchan: str, gpu_index: int | None = None, uuid: str = "n/a") -> Finding:
    """A rank that outlived SIGKILL: the kernel cannot finish it (uninterruptible sleep, typically in the GPU
    driver after an XID 79 or a hung GPU), and the GPU it holds stays held until a reset or a reboot."""
    return Finding(gpu_index, uuid, "rank stopped", "the rank gone after SIGKILL",
                   f"rank {rank} (pid {pid}) still there after SIGKILL, state {state}, waiting in the kernel at "
                   f"{wchan}", "gpu-hardware", "reset",
                   f"drain the node; reset the GPU (nvidia-smi -r) or reboot: the process cannot be killed "
                   f"(cat /proc/{pid}/stack shows where it waits; an NFS or FUSE mount there is the mount's fault); "
                   f"look for an XID in the kernel log")


def nvml_stalled(why: str) -> Finding:
    """NVML asked for the node's GPUs and not answering: the driver is stuck on a GPU (it answers in well under a
    second otherwise)."""
    return Finding(None, "n/a", "NVML answers", "the GPUs listed by NVML within the survey's deadline", why,
                   "gpu-hardware", "reset", "drain the node and reboot it (a GPU reset needs an NVML that answers); "
                   "look in the kernel log for the XID (79, 119 GSP timeout) that stuck the driver; if it recurs, "
                   + RMA)


# A rank that died on one of these may have died of its GPU (CUDA aborts on a lost context; a GPU fallen off the
# bus faults the mapped memory): its GPU is looked at again before the run's verdict is settled.
FATAL_SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE")


def after_a_signal(rank: int, died_on: str, gpu: Gpu, gpus_now: list[Gpu] | None, xid_findings: list[Finding],
                   unreachable_now: dict[int, str] | None = None, stalled_now: str = "") -> list[Finding]:
    """Rank `rank`, which drove `gpu`, died on signal `died_on`: what NVML says of that GPU now (the survey after
    the death: `gpus_now`, None when NVML could not start; `unreachable_now` {index: error}; `stalled_now`: why
    it did not answer in time), and the XIDs the kernel logged for it during the run (health.xid_findings of
    them). [] when the GPU reads as it did: the death then names no machine."""
    why = f"after rank {rank} died on {died_on}"
    if gpus_now is None or stalled_now:
        return [nvml_stalled(f"{stalled_now or 'NVML could not start'} ({why})"), *xid_findings]
    if gpu.index in (unreachable_now or {}):
        return [unreachable(gpu.index, f"{(unreachable_now or {})[gpu.index]} ({why})"), *xid_findings]
    same = [g for g in gpus_now if g.uuid == gpu.uuid]
    if not same:
        return [Finding(gpu.index, gpu.uuid, "GPU listed by NVML", f"GPU {gpu.index} {gpu.uuid} still listed {why}",
                        "not listed any more", "gpu-hardware", "isolate",
                        "drain the node; check the kernel log for Xid 79 on this GPU and nvidia-smi; reboot; if it "
                        "recurs, " + RMA), *xid_findings]
    return [*findings(same[0], gpus_now), *xid_findings]


# --- the host around the GPUs ---------------------------------------------------------------------------------------

SHM_FIX = ("run the container with --ipc=host (or --shm-size=8g); Kubernetes: an emptyDir with medium: Memory mounted "
           "at /dev/shm")


def shm_too_small(size_bytes: int, minimum_bytes: int) -> list[Finding]:
    """/dev/shm smaller than NCCL's SHM transport and DataLoader workers need (Docker's default is 64 MiB: they
    then fail mid-run with "unable to write to file </torch_...>")."""
    if size_bytes >= minimum_bytes:
        return []
    mib = 1 << 20
    return [Finding(None, "", "/dev/shm size", f">= {minimum_bytes / mib:.0f} MiB (--min-shm, "
                    "STACKPROOF_MIN_SHM_BYTES) for NCCL and DataLoader workers", f"{size_bytes / mib:.0f} MiB",
                    "configuration", "triage", SHM_FIX)]
