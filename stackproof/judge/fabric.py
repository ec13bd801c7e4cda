"""The network, judged: RDMA ports against what the node should have (the spec, else the job's other nodes and the
node's own ports), the transport NCCL chose across nodes against the ports that are up, and the bars for
cross-node bandwidth from the NICs' line rate. Pure: fabric facts (stackproof/measure/fabric.py's Fabric as JSON)
in, Findings and bars out; unit-tested in tests/test_fabric.py without torch or a NIC.

What NHC (check_hw_ib, check_ib_link_flapping) and IBM Autopilot check first, as rules:
- a port whose physical link is up but whose logical state is not ACTIVE (INIT, ARMED): no subnet manager
  configured it;
- fewer ports up than the spec (or than the job's other nodes) has: a cable, transceiver or switch port;
- a port up at less than its expected rate (a 200 Gb/s HDR port trained at 100): a cable or transceiver;
- a port whose link went down more than --max-link-downed times since its counters were cleared: a flapping link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stackproof.judge.bars import Bar
from stackproof.judge.findings import Finding

GBIT_BYTES = 1e9 / 8
CHECK = "fabric"
FLAP_FIX = ("a flapping link: reseat or replace the cable/transceiver, check the switch port's error counters "
            "(perfquery -x, ibqueryerrors); clear the counters (perfquery -R) once fixed")
PORT_FIX = ("check the cable, transceiver and switch port (ibstat, iblinkinfo); a port that should stay unused "
            "must not be in the spec (make it again from known-good runs)")
SM_FIX = ("the link is up but no subnet manager configured the port: check opensm/UFM on the fabric (sminfo), "
          "then the port (ibstat)")
RATE_FIX = ("the port trained below its rate: reseat or replace the cable/transceiver (ibstat, mlxlink -d "
            "<device> -m), then check the switch port's speed")
TRANSPORT_FIX = ("NCCL found no usable RDMA device and fell back to TCP sockets: run an image that carries rdma-core "
                 "(libibverbs1 and ibverbs-providers; stackproof's runtime images do), give the container the "
                 "RDMA devices (/dev/infiniband: the RDMA device plugin on Kubernetes, --device=/dev/infiniband "
                 "with Docker), unset NCCL_IB_DISABLE and NCCL_NET, and set NCCL_IB_HCA to these HCAs (or leave "
                 "it unset)")
GDR_FIX = ("nvidia_peermem is loaded and the GPU shares a PCIe switch with a NIC, yet NCCL used no GPUDirect RDMA: "
           "check NCCL_NET_GDR_LEVEL / NCCL_NET_GDR_READ, the ACS settings of the PCIe switch (ACS must be off for "
           "peer-to-peer), and that the container sees the peermem device")


# --- facts, summed up ------------------------------------------------------------------------------------------

def up_ports(fabric: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in fabric.get("ports", ()) if p["state"] == "ACTIVE" and p["phys_state"] == "LinkUp"]


def node_facts(fabric: Mapping[str, Any] | None) -> dict[str, Any]:
    """The node spec's fabric fields (judge/spec.py): RDMA ports up, their slowest rate (Gb/s) and link layer."""
    if not fabric:
        return {"fabric_ports_up": None, "fabric_port_rate_gbps": None, "fabric_link_layer": None}
    ports = up_ports(fabric)
    rates = [p["rate_gbps"] for p in ports if p.get("rate_gbps")]
    layers = sorted({p["link_layer"] for p in ports})
    return {"fabric_ports_up": len(ports), "fabric_port_rate_gbps": min(rates) if rates else None,
            "fabric_link_layer": "+".join(layers) or None}


def describe(fabric: Mapping[str, Any]) -> str:
    """'mlx5_0/1 ACTIVE 200 Gb/s InfiniBand, mlx5_1/1 DOWN (Polling); eth0 up 25 Gb/s' (a figure's text)."""
    ports = [f"{p['device']}/{p['port']} {p['state']}" + (f" {p['rate_gbps']:g} Gb/s {p['link_layer']}"
                                                          if p['state'] == "ACTIVE" and p.get("rate_gbps")
                                                          else f" ({p['phys_state']})")
             for p in fabric.get("ports", ())]
    nics = [f"{n['name']} {n['operstate']}" + (f" {n['speed_mbps'] / 1000:g} Gb/s" if n.get("speed_mbps") else "")
            for n in fabric.get("ethernet", ())]
    return "; ".join(part for part in (", ".join(ports), ", ".join(nics)) if part) or "no NIC in sysfs"


# --- the ports, judged (the fast tier) -------------------------------------------------------------------------

def expectation(mine: Mapping[str, Any], others: Sequence[Mapping[str, Any]],
                spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """What this node's ports should be: the spec's fields where it has them, else the most ports up any node of
    the job has, and the fastest rate an up port of the node or the job trained to (one degraded port never lowers
    its own bar)."""
    spec = spec or {}
    every = [mine, *others]
    counts = [len(up_ports(f)) for f in every]
    rates = [p["rate_gbps"] for f in every for p in up_ports(f) if p.get("rate_gbps")]
    return {"ports_up": spec.get("fabric_ports_up") if spec.get("fabric_ports_up") is not None else max(counts),
            "rate_gbps": spec.get("fabric_port_rate_gbps") or (max(rates) if rates else None),
            "source": "the node spec" if spec.get("fabric_ports_up") is not None else
            "the job's nodes" if others else "this node's own ports"}


def _finding(what: str, expected: str, found: str, category: str, severity: str, fix: str) -> Finding:
    return Finding(None, "", f"{CHECK} {what}", expected, found, category, severity, fix)


def port_findings(fabric: Mapping[str, Any], expect: Mapping[str, Any], max_link_downed: int) -> list[Finding]:
    """Every way this node's RDMA ports fall short of `expect` (expectation()), each with the fix."""
    found = [_finding("sysfs", "readable NIC facts", problem, "tool-error", "triage",
                      "check that sysfs is mounted (validate --sysfs)") for problem in fabric.get("problems", ())]
    ports = list(fabric.get("ports", ()))
    up = up_ports(fabric)
    for p in ports:
        name = f"{p['device']}/{p['port']}"
        if p["phys_state"] == "LinkUp" and p["state"] != "ACTIVE":
            found.append(_finding(f"port {name} state", "ACTIVE (physical link up)", f"{p['state']} (LinkUp)",
                                  "configuration", "triage", SM_FIX))
        if p.get("link_downed") is not None and p["link_downed"] > max_link_downed:
            found.append(_finding(f"port {name} link flaps", f"link_downed <= {max_link_downed} (--max-link-downed)",
                                  f"link_downed = {p['link_downed']}", "interconnect", "triage", FLAP_FIX))
    want = expect.get("ports_up")
    if want is not None and len(up) < want:
        down = [f"{p['device']}/{p['port']} {p['state']} ({p['phys_state']})" for p in ports if p not in up]
        found.append(_finding("RDMA ports up", f"{want} ({expect.get('source')})",
                              f"{len(up)}" + (f": {', '.join(down)}" if down else ""), "interconnect", "isolate",
                              PORT_FIX))
    rate = expect.get("rate_gbps")
    for p in up:
        if rate and p.get("rate_gbps") is not None and p["rate_gbps"] < rate:
            found.append(_finding(f"port {p['device']}/{p['port']} rate", f"{rate:g} Gb/s ({expect.get('source')})",
                                  f"{p['rate_gbps']:g} Gb/s", "interconnect", "triage", RATE_FIX))
    return found


# --- the transport NCCL chose -------------------------------------------------------------------------------------

P2P_FIX = "NVLink is up but NCCL avoided P2P: unset NCCL_P2P_DISABLE / NCCL_P2P_LEVEL, check IOMMU/ACS"
UNLOGGED_FIX = ("leave NCCL_DEBUG and NCCL_DEBUG_SUBSYS to stackproof (it asks NCCL for INIT logs), and check that the "
                "log folder is writable")


def local_transport_findings(transports: Sequence[str], kinds: Sequence[str], nvlink_up: bool, num_nodes: int,
                             log: str) -> list[Finding]:
    """On one node: NCCL said which transport it chose (`transports`, read from `log`; `kinds` their kinds),
    and with NVLink up on every GPU it chose P2P."""
    if not transports:
        return [_finding("NCCL transport", f"NCCL's transport choice in its log {log}", "none logged",
                         "configuration", "triage", UNLOGGED_FIX)]
    if nvlink_up and num_nodes == 1 and "P2P" not in kinds:
        return [_finding("NCCL transport", "P2P (NVLink is up on every GPU)", ", ".join(transports),
                         "configuration", "triage", P2P_FIX)]
    return []


# --- the transport across nodes ----------------------------------------------------------------------------------

def transport_findings(transports: Sequence[str], num_nodes: int, fabrics: Mapping[str, Mapping[str, Any]],
                       node: str, gpu_nic_paths: Mapping[str, Mapping[str, str]] | None = None,
                       emulated: bool = False) -> list[Finding]:
    """One rank's NCCL transports (`transports`, on `node`) across nodes: TCP sockets while every node of the job
    has RDMA ports up is a configuration fault (the fix: rdma-core in the image, the RDMA devices in the container,
    NCCL_IB_HCA); RDMA without GPUDirect where nvidia_peermem is loaded on the node and its GPU shares a PCIe switch
    with a NIC (PIX/PXB in `gpu_nic_paths`) is one too. (A node without RDMA ports up forces sockets on its peers:
    the fabric check names that node.) Emulated nodes (one machine, NCCL_HOSTID per node: docs/launchers.md) use
    sockets by design: nothing to judge there."""
    if num_nodes < 2 or emulated:
        return []
    net = sorted({t for t in transports if t.startswith("NET/")})
    found = []
    with_rdma = {name: up_ports(f) for name, f in fabrics.items() if up_ports(f)}
    if any(t.startswith("NET/Socket") for t in net) and with_rdma and len(with_rdma) == len(fabrics):
        said = "; ".join(f"{name}: " + ", ".join(f"{p['device']}/{p['port']} {p['link_layer']} "
                                                 f"{p.get('rate_gbps') or 0:g} Gb/s" for p in ports)
                         for name, ports in sorted(with_rdma.items()))
        found.append(_finding("NCCL transport across nodes", f"NET/IB (RDMA ports up on every node: {said})",
                              ", ".join(net), "configuration", "triage", TRANSPORT_FIX))
    rdma = [t for t in net if t.startswith("NET/IB")]
    close = any(kind in ("PIX", "PXB") for paths in (gpu_nic_paths or {}).values() for kind in paths.values())
    if rdma and (fabrics.get(node) or {}).get("peermem") and close and not any("GDRDMA" in t for t in rdma):
        found.append(_finding("GPUDirect RDMA", "NET/IB/.../GDRDMA (nvidia_peermem loaded, GPU and NIC on one "
                              "PCIe switch)", ", ".join(rdma), "configuration", "triage", GDR_FIX))
    return found


# --- cross-node bars ----------------------------------------------------------------------------------------------

def node_line_rate(fabric: Mapping[str, Any] | None, expect: Mapping[str, Any]) -> tuple[float, str]:
    """(GB/s, label) the node's network should carry, each direction: RDMA ports up to the expected count at the
    expected rate (a port down or trained low lowers the figure, never the bar); with no RDMA port, its physical
    Ethernet interfaces that are up (NCCL's socket transport). (0.0, why) when sysfs shows neither."""
    if fabric and expect.get("ports_up") and expect.get("rate_gbps"):
        count, rate = expect["ports_up"], expect["rate_gbps"]
        return count * rate * GBIT_BYTES / 1e9, f"{count} RDMA port(s) x {rate:g} Gb/s"
    nics = [n for n in (fabric or {}).get("ethernet", ()) if n["operstate"] == "up" and n.get("speed_mbps")]
    if nics:
        total = sum(n["speed_mbps"] for n in nics) / 1000
        return total * GBIT_BYTES / 1e9, f"Ethernet {', '.join(n['name'] for n in nics)}: {total:g} Gb/s"
    return 0.0, "sysfs shows no RDMA port up and no Ethernet interface with a speed"


def cross_node_busbw_bar(line_rates: Mapping[str, tuple[float, str]], fraction: float, emulated: bool) -> Bar:
    """The busbw a cross-node all_reduce's largest size must reach: `fraction` x the slowest node's line rate. A
    ring (or tree) all_reduce moves 2(n-1)/n of the data over each node's network links in each direction, as
    busbw counts it, so busbw is bounded by the node's line rate (its NICs together); NVLink inside the node is
    faster and bounds nothing here."""
    if emulated:
        return Bar(None, "emulated nodes share one host (--emulated-nodes): the NICs' line rate does not bound "
                         "their link; pass --min-busbw")
    if not line_rates:
        return Bar(None, "not derived across nodes: no NIC facts (sysfs class/infiniband, class/net); pass "
                         "--min-busbw")
    node, (gbps, label) = min(line_rates.items(), key=lambda item: item[1][0])
    if not gbps:
        return Bar(None, f"not derived across nodes: {node}: {label}; pass --min-busbw")
    return Bar(round(fraction * gbps, 2), f"{fraction:g} x {gbps:g} GB/s line rate of {node} ({label})")


def node_pair_bar(line_rates: Mapping[str, tuple[float, str]], ranks_per_node: int, fraction: float,
                  emulated: bool) -> Bar:
    """The bar of a pair of nodes in the pairwise pass, where every local rank k of one node exchanges with local
    rank k of the other at once, both ways: each rail's share of the slower node's line rate, x `fraction`."""
    bar = cross_node_busbw_bar(line_rates, fraction, emulated)
    if bar.value is None:
        return Bar(None, bar.source.replace("pass --min-busbw", "pass --min-pair-gbps"))
    per_rail = bar.value / max(1, ranks_per_node)
    return Bar(round(per_rail, 3), bar.source + (f" / {ranks_per_node} rails" if ranks_per_node > 1 else ""))
