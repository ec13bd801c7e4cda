"""The node's network as sysfs describes it: each RDMA port (InfiniBand or RoCE: /sys/class/infiniband/*/ports/*:
state, phys_state, rate, link_layer, the link_downed counter), each physical Ethernet interface
(/sys/class/net/*: operstate, speed) and where each NIC sits on the PCI tree relative to each GPU. Reads only;
stackproof/judge/fabric.py decides. Nothing here blocks: sysfs files answer at once, so the fast tier (a Prolog)
can afford all of it (benchmarks/fabric.py prints the time).

The root is a parameter (validate --sysfs) so that a container that mounts the host's sysfs elsewhere, and the
tests (tests/fixtures/sysfs/), read another tree.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

from stackproof.measure.topology import sysfs_name

SYSFS = "/sys"
GBIT = 1e9 / 8  # bytes per second in one Gb/s


@dataclasses.dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device (an HCA's InfiniBand port, or a RoCE NIC's Ethernet port)."""

    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED (the word after "4: ")
    phys_state: str  # LinkUp, Disabled, Polling, ... (the word after "5: ")
    rate_gbps: float | None  # the rate it trained to, Gb/s ("400 Gb/sec (4X NDR)" -> 400); None: unreadable
    link_layer: str  # InfiniBand or Ethernet (RoCE)
    link_downed: int | None  # times the link went down since the counters were cleared (flaps); None: no counter
    pci_bus_id: str | None  # the NIC's PCI function, 0000:17:00.0
    netdev: str | None = None  # RoCE: the Ethernet interface behind the port

    @property
    def up(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


@dataclasses.dataclass(frozen=True)
class EthernetNic:
    """A physical network interface (one with a PCI device behind it; lo, veth and bridges have none)."""

    name: str
    operstate: str  # up, down, unknown
    speed_mbps: int | None  # None: the driver reports none (-1 while down, virtio often)
    pci_bus_id: str | None


@dataclasses.dataclass(frozen=True)
class Fabric:
    ports: tuple[RdmaPort, ...]
    ethernet: tuple[EthernetNic, ...]
    peermem: bool  # nvidia_peermem (GPUDirect RDMA) is loaded
    problems: tuple[str, ...] = ()  # files that exist and could not be read: said, never guessed

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _word(text: str | None) -> str:
    """'4: ACTIVE' -> 'ACTIVE'; '5: LinkUp' -> 'LinkUp'."""
    return (text or "").split(":", 1)[-1].strip()


def parse_rate(text: str | None) -> float | None:
    """'400 Gb/sec (4X NDR)' -> 400.0; '2.5 Gb/sec (1X SDR)' -> 2.5."""
    match = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(match.group(1)) if match else None


_PCI_NAME = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _pci_of(device_dir: Path) -> str | None:
    """The PCI function a class device hangs off (0000:17:00.0): the last PCI name on the path its `device` link
    resolves to (a virtio NIC's link ends in virtio2, below its PCI function). None: no PCI function found."""
    link = device_dir / "device"
    if not link.exists():
        return None
    return next((part for part in reversed(Path(os.path.realpath(link)).parts) if _PCI_NAME.match(part)), None)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def read_ports(root: Path) -> tuple[list[RdmaPort], list[str]]:
    ports, problems = [], []
    base = root / "class" / "infiniband"
    for device in sorted(base.iterdir()) if base.is_dir() else []:
        pci = _pci_of(device)
        for port_dir in sorted((device / "ports").iterdir(), key=lambda p: _int(p.name) or 0) \
                if (device / "ports").is_dir() else []:
            fields = {name: _read(port_dir / name) for name in ("state", "phys_state", "rate", "link_layer")}
            missing = [name for name, value in fields.items() if value is None]
            if missing:
                problems.append(f"{device.name}/{port_dir.name}: unreadable {', '.join(missing)} in {port_dir}")
            ndevs = port_dir / "gid_attrs" / "ndevs" / "0"
            ports.append(RdmaPort(device.name, _int(port_dir.name) or 0, _word(fields["state"]) or "unknown",
                                  _word(fields["phys_state"]) or "unknown", parse_rate(fields["rate"]),
                                  fields["link_layer"] or "unknown",
                                  _int(_read(port_dir / "counters" / "link_downed")), pci, _read(ndevs) or None))
    return ports, problems


def read_ethernet(root: Path) -> list[EthernetNic]:
    nics = []
    base = root / "class" / "net"
    for nic in sorted(base.iterdir()) if base.is_dir() else []:
        if not (nic / "device").exists():  # virtual: lo, veth, bridges, tunnels
            continue
        pci = _pci_of(nic)
        speed = _int(_read(nic / "speed"))
        nics.append(EthernetNic(nic.name, _read(nic / "operstate") or "unknown",
                                speed if speed is not None and speed > 0 else None, pci))
    return nics


# TCP's counters of this process's network namespace (a node's, or its pod's): what gloo and NCCL's socket
# transport send, and how much of it TCP had to send again because it was lost (a link that drops packets).
PROC_NET_SNMP = "/proc/net/snmp"
PROC_NET_NETSTAT = "/proc/net/netstat"


@dataclasses.dataclass(frozen=True)
class TcpSegments:
    sent: int  # Tcp: OutSegs
    retransmitted: int  # Tcp: RetransSegs
    # TcpExt: TCPDSACKRecvSegs: resent segments the peer reports it already had (a probe or timeout fired while
    # the ACK was late, as on a busy host): sent again, but not lost.
    duplicates: int = 0

    def since(self, before: TcpSegments) -> TcpSegments:
        return TcpSegments(self.sent - before.sent, self.retransmitted - before.retransmitted,
                           self.duplicates - before.duplicates)

    @property
    def lost(self) -> int:
        """Segments sent again because they did not arrive."""
        return max(0, self.retransmitted - self.duplicates)


def _counters(path: str | Path, prefix: str) -> dict[str, int]:
    header, values = [line.split()[1:] for line in Path(path).read_text().splitlines()
                      if line.startswith(prefix)][:2]
    return dict(zip(header, map(int, values), strict=True))


def tcp_segments(snmp: str | Path = PROC_NET_SNMP, netstat: str | Path = PROC_NET_NETSTAT) -> TcpSegments | None:
    """This network namespace's TCP segments sent, retransmitted and reported back as duplicates so far; None
    where the kernel shows no TCP counters (no duplicate count where it keeps none: every resend counts)."""
    try:
        tcp = _counters(snmp, "Tcp:")
        segments = TcpSegments(tcp["OutSegs"], tcp["RetransSegs"])
    except (OSError, ValueError, KeyError):
        return None
    try:
        return dataclasses.replace(segments, duplicates=_counters(netstat, "TcpExt:")["TCPDSACKRecvSegs"])
    except (OSError, ValueError, KeyError):
        return segments


def read(root: str | Path = SYSFS) -> Fabric:
    root = Path(root)
    ports, problems = read_ports(root)
    return Fabric(tuple(ports), tuple(read_ethernet(root)), (root / "module" / "nvidia_peermem").is_dir(),
                  tuple(problems))


# --- where a NIC sits relative to a GPU -------------------------------------------------------------------------

def pci_chain(root: str | Path, pci_bus_id: str) -> list[str]:
    """The PCI functions from the root complex down to this one (bridges, then the function), from the path sysfs
    resolves /sys/bus/pci/devices/<id> to: /sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0 ->
    ['pci0000:00', '0000:00:01.0', '0000:17:00.0']. Empty when the function is not there."""
    link = Path(root) / "bus" / "pci" / "devices" / sysfs_name(pci_bus_id)
    if not link.exists():
        return []
    parts = Path(os.path.realpath(link)).parts
    start = next((i for i, part in enumerate(parts) if part.startswith("pci")), None)
    return list(parts[start:]) if start is not None else []


def path_type(gpu_chain: Sequence[str], nic_chain: Sequence[str]) -> str:
    """nvidia-smi topo's words for the path between two PCI functions: PIX (one PCIe switch between them), PXB
    (several switches, no host bridge), PHB (through the host bridge of one root complex), SYS (across root
    complexes or sockets); '' when either chain is unknown."""
    if not gpu_chain or not nic_chain:
        return ""
    if gpu_chain[0] != nic_chain[0]:
        return "SYS"
    shared = 0
    for a, b in zip(gpu_chain, nic_chain, strict=False):
        if a != b:
            break
        shared += 1
    # shared == 1: only the root complex; the first bridge below it is a root port.
    if shared <= 1:
        return "PHB"
    below = max(len(gpu_chain), len(nic_chain)) - shared
    return "PIX" if below <= 2 else "PXB"


def gpu_nic_paths(root: str | Path, gpu_bus_ids: Sequence[str], nics: Sequence[str]) -> dict[str, dict[str, str]]:
    """{GPU bus id: {NIC PCI id: path type}} for every GPU and NIC (the GPU↔NIC part of nvidia-smi topo -m)."""
    nic_chains = {nic: pci_chain(root, nic) for nic in nics}
    return {gpu: {nic: path_type(pci_chain(root, gpu), chain) for nic, chain in nic_chains.items()}
            for gpu in gpu_bus_ids}


def job_fabrics(dist_env, root: str | Path, node: str) -> dict[str, dict]:
    """{node name: its Fabric as JSON} for every node of the job: local rank 0 of each node reads its sysfs, and
    the ranks agree on the lot (one O(ranks) exchange, dist_env.agree)."""
    mine = read(root).to_json() if dist_env.local_rank == 0 else None
    return dist_env.agree({"node": node, "fabric": mine}, "the NIC facts",
                          lambda values: {v["node"]: v["fabric"] for v in values if v["fabric"] is not None})
