"""The network from sysfs, judged: NIC facts read from fixture trees (tests/fixtures/sysfs/fabric-2xhdr: two 200 Gb/s
HDR ports, one on the GPU's PCIe switch, one across the sockets; eth0 at 25 Gb/s; nvidia_peermem loaded), each
fault made by editing a copy of the tree, and the rules of stackproof/judge/fabric.py on them; then the fast-tier
check in a real CPU run pointed at the trees (--sysfs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_validate_cpu import validate

from stackproof.judge import fabric as rules
from stackproof.judge import spec as node_spec
from stackproof.measure import fabric

FIXTURE = Path(__file__).parent / "fixtures" / "sysfs" / "fabric-2xhdr"
GPU = "00000000:03:00.0"


@pytest.fixture
def tree(tmp_path) -> Path:
    copy = tmp_path / "sys"
    shutil.copytree(FIXTURE, copy, symlinks=True)
    return copy


def port(tree: Path, device: str, name: str, text: str) -> None:
    (tree / "class" / "infiniband" / device / "ports" / "1" / name).write_text(text + "\n")


def facts(tree: Path) -> dict:
    return fabric.read(tree).to_json()


def judged(tree: Path, others=(), spec=None, max_link_downed=3):
    mine = facts(tree)
    return rules.port_findings(mine, rules.expectation(mine, list(others), spec), max_link_downed)


# --- reading ----------------------------------------------------------------------------------------------------

def test_ports_nics_and_peermem_are_read_from_sysfs():
    found = fabric.read(FIXTURE)
    assert [(p.name, p.state, p.phys_state, p.rate_gbps, p.link_layer, p.link_downed, p.pci_bus_id)
            for p in found.ports] == [("mlx5_0/1", "ACTIVE", "LinkUp", 200.0, "InfiniBand", 1, "0000:04:00.0"),
                                      ("mlx5_1/1", "ACTIVE", "LinkUp", 200.0, "InfiniBand", 1, "0000:81:00.0")]
    assert [(n.name, n.operstate, n.speed_mbps) for n in found.ethernet] == [("eth0", "up", 25000)]  # lo: virtual
    assert found.peermem and not found.problems
    assert rules.node_facts(found.to_json()) == {"fabric_ports_up": 2, "fabric_port_rate_gbps": 200.0,
                                                 "fabric_link_layer": "InfiniBand"}


def test_no_sysfs_tree_is_no_nic_not_an_error(tmp_path):
    found = fabric.read(tmp_path)
    assert found.ports == () and found.ethernet == () and not found.peermem
    assert rules.describe(found.to_json()) == "no NIC in sysfs"


def test_the_pci_path_between_gpu_and_nic_in_nvidia_smi_topo_words():
    paths = fabric.gpu_nic_paths(FIXTURE, [GPU], ["0000:04:00.0", "0000:81:00.0", "0000:05:00.0", "0000:99:00.0"])
    assert paths == {GPU: {"0000:04:00.0": "PIX", "0000:81:00.0": "SYS", "0000:05:00.0": "PHB", "0000:99:00.0": ""}}


@pytest.mark.parametrize(("text", "gbps"), [("400 Gb/sec (4X NDR)", 400.0), ("2.5 Gb/sec (1X SDR)", 2.5),
                                            ("100 Gb/sec (4X EDR)", 100.0), ("garbage", None), (None, None)])
def test_rate_text(text, gbps):
    assert fabric.parse_rate(text) == gbps


# --- the ports, judged --------------------------------------------------------------------------------------------

def test_healthy_ports_have_no_finding(tree):
    assert judged(tree) == []
    assert judged(tree, others=[facts(tree)], spec={"fabric_ports_up": 2, "fabric_port_rate_gbps": 200}) == []


def test_a_port_down_is_named_against_the_spec_and_against_the_other_nodes(tree):
    healthy = facts(FIXTURE)
    port(tree, "mlx5_1", "state", "1: DOWN")
    port(tree, "mlx5_1", "phys_state", "2: Polling")
    for found in (judged(tree, spec={"fabric_ports_up": 2}), judged(tree, others=[healthy])):
        (finding,) = found
        assert finding.check == "fabric RDMA ports up" and finding.found == "1: mlx5_1/1 DOWN (Polling)"
        assert (finding.category, finding.severity) == ("interconnect", "isolate") and "cable" in finding.action
    assert judged(tree) == []  # one node, no spec: a port down may be unused; nothing says it should be up


def test_a_200_gb_port_trained_at_100_is_named_by_its_own_node(tree):
    port(tree, "mlx5_1", "rate", "100 Gb/sec (4X EDR)")
    (finding,) = judged(tree)
    assert finding.check == "fabric port mlx5_1/1 rate"
    assert (finding.expected, finding.found) == ("200 Gb/s (this node's own ports)", "100 Gb/s")
    (spec_said,) = judged(tree, spec={"fabric_ports_up": 2, "fabric_port_rate_gbps": 200})
    assert spec_said.expected == "200 Gb/s (the node spec)"


def test_link_up_without_a_subnet_manager_and_a_flapping_link(tree):
    port(tree, "mlx5_0", "state", "2: INIT")
    port(tree, "mlx5_1", "counters/link_downed", "17")
    found = {f.check: f for f in judged(tree, max_link_downed=3)}
    assert found["fabric port mlx5_0/1 state"].found == "INIT (LinkUp)"
    assert "subnet manager" in found["fabric port mlx5_0/1 state"].action
    assert found["fabric port mlx5_1/1 link flaps"].found == "link_downed = 17"
    assert found["fabric port mlx5_1/1 link flaps"].category == "interconnect"


def test_an_unreadable_port_file_is_said(tree):
    (tree / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "rate").unlink()
    found = facts(tree)
    assert list(found["problems"]) == [f"mlx5_0/1: unreadable rate in {tree}/class/infiniband/mlx5_0/ports/1"]
    assert [f.category for f in judged(tree)] == ["tool-error"]


# --- the transport across nodes ----------------------------------------------------------------------------------

def test_socket_fallback_with_ib_up_is_a_configuration_finding_with_the_fix():
    fabrics = {"gpu-a": facts(FIXTURE), "gpu-b": facts(FIXTURE)}
    (finding,) = rules.transport_findings(["NET/Socket/0", "P2P/CUMEM"], 2, fabrics, "gpu-a")
    assert finding.check == "fabric NCCL transport across nodes" and finding.found == "NET/Socket/0"
    assert "gpu-a: mlx5_0/1 InfiniBand 200 Gb/s" in finding.expected
    assert finding.category == "configuration"
    assert all(word in finding.action for word in ("rdma-core", "NCCL_IB_HCA", "device plugin"))
    assert rules.transport_findings(["NET/IB/0/GDRDMA"], 2, fabrics, "gpu-a") == []
    assert rules.transport_findings(["NET/Socket/0"], 1, fabrics, "gpu-a") == []  # one node: NET is not used
    assert rules.transport_findings(["NET/Socket/0"], 2, fabrics, "gpu-a", emulated=True) == []
    no_ib = {n: {**f, "ports": []} for n, f in fabrics.items()}
    assert rules.transport_findings(["NET/Socket/0"], 2, no_ib, "gpu-a") == []  # sockets are all there is
    one_without = {**fabrics, "gpu-b": no_ib["gpu-b"]}  # gpu-b forces sockets: the fabric check names gpu-b
    assert rules.transport_findings(["NET/Socket/0"], 2, one_without, "gpu-a") == []


def test_gpudirect_rdma_is_expected_where_peermem_is_loaded_and_the_nic_is_close():
    fabrics = {"gpu-a": facts(FIXTURE), "gpu-b": facts(FIXTURE)}
    close = fabric.gpu_nic_paths(FIXTURE, [GPU], ["0000:04:00.0"])
    far = fabric.gpu_nic_paths(FIXTURE, [GPU], ["0000:81:00.0"])
    (finding,) = rules.transport_findings(["NET/IB/0"], 2, fabrics, "gpu-a", close)
    assert finding.check == "fabric GPUDirect RDMA" and "ACS" in finding.action
    assert rules.transport_findings(["NET/IB/0"], 2, fabrics, "gpu-a", far) == []  # across sockets: rightly not
    unloaded = {n: {**f, "peermem": False} for n, f in fabrics.items()}
    assert rules.transport_findings(["NET/IB/0"], 2, unloaded, "gpu-a", close) == []


# --- bars from the line rate --------------------------------------------------------------------------------------

def test_cross_node_bars_come_from_the_slowest_nodes_line_rate(tree):
    port(tree, "mlx5_1", "state", "1: DOWN")
    healthy = facts(FIXTURE)
    expect = rules.expectation(healthy, [facts(tree)], None)
    rates = {"gpu-a": rules.node_line_rate(healthy, expect), "gpu-b": rules.node_line_rate(facts(tree), expect)}
    assert rates["gpu-b"] == (50.0, "2 RDMA port(s) x 200 Gb/s")  # a port down lowers the figure, not the bar
    bar = rules.cross_node_busbw_bar(rates, 0.5, emulated=False)
    assert bar.value == 25.0 and bar.source.startswith("0.5 x 50 GB/s line rate of gpu-a")
    pair = rules.node_pair_bar(rates, 4, 0.5, emulated=False)
    assert pair.value == 6.25 and pair.source.endswith("/ 4 rails")


def test_without_rdma_the_ethernet_line_rate_and_without_nics_a_reason():
    no_ib = {**facts(FIXTURE), "ports": []}
    assert rules.node_line_rate(no_ib, rules.expectation(no_ib, [], None)) == (3.125, "Ethernet eth0: 25 Gb/s")
    empty = {"ports": [], "ethernet": [], "peermem": False}
    gone = rules.cross_node_busbw_bar({"n1": rules.node_line_rate(empty, {})}, 0.5, False)
    assert gone.value is None and "no RDMA port up and no Ethernet interface" in gone.source
    assert "no NIC facts" in rules.cross_node_busbw_bar({}, 0.5, False).source
    assert "emulated" in rules.cross_node_busbw_bar({"n1": (50.0, "x")}, 0.5, True).source


def test_the_spec_records_the_fabric_and_leaves_judging_it_to_the_fabric_check():
    assert {"fabric_ports_up", "fabric_port_rate_gbps", "fabric_link_layer"} <= set(node_spec.FIELDS)
    assert all(rule.judged_by == node_spec.FABRIC_CHECK for rule in node_spec.RULES if rule.field.startswith("fabric"))


# --- the fast-tier check, in a real run ---------------------------------------------------------------------------

def test_the_fast_tier_check_names_a_downtrained_port_and_passes_a_healthy_tree(tree, tmp_path):
    proc, report = validate(tmp_path / "ok", "--nproc", "2", "--tier", "fast", "-k", "fabric", "--sysfs",
                            str(FIXTURE))
    assert proc.returncode == 0, proc.stdout[-3000:]
    (check,) = report["checks"]
    assert check["name"] == "fabric::rdma_ports_hold_their_spec" and check["outcome"] == "passed", check
    assert check["figures"]["ports_up"]["value"] == 2
    assert report["tables"]["fabric"][0]["fabric_port_rate_gbps"] == 200.0
    port(tree, "mlx5_1", "rate", "100 Gb/sec (4X EDR)")
    proc, report = validate(tmp_path / "bad", "--nproc", "2", "--tier", "fast", "-k", "fabric", "--sysfs",
                            str(tree))
    assert proc.returncode == 1, proc.stdout[-3000:]
    (check,) = report["checks"]
    assert check["outcome"] == "failed" and check["failed_ranks"] == [0, 1]
    assert "fabric port mlx5_1/1 rate: expected 200 Gb/s (this node's own ports), found 100 Gb/s" in check["message"]


def test_no_rdma_port_skips_saying_so(tmp_path):
    _proc, report = validate(tmp_path, "--nproc", "2", "--tier", "fast", "-k", "fabric", "--sysfs", str(tmp_path))
    (check,) = report["checks"]
    assert check["outcome"] == "skipped" and "no RDMA port in sysfs" in check["message"], check


SNMP = ("Ip: Forwarding DefaultTTL InReceives\nIp: 2 64 1000\n"
        "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs "
        "OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
        "Tcp: 1 200 120000 -1 10 5 0 0 3 9000 10000 37 0 2 0\n"
        "Udp: InDatagrams NoPorts\nUdp: 1 2\n")  # /proc/net/snmp's shape


def test_tcp_segments_are_read_from_the_namespaces_snmp_counters(tmp_path):
    (tmp_path / "snmp").write_text(SNMP)
    (tmp_path / "netstat").write_text("TcpExt: SyncookiesSent TCPDSACKRecv TCPDSACKRecvSegs\nTcpExt: 0 30 31\n")
    before = fabric.tcp_segments(tmp_path / "snmp", tmp_path / "netstat")
    assert before == fabric.TcpSegments(sent=10000, retransmitted=37, duplicates=31) and before.lost == 6
    assert fabric.TcpSegments(12000, 40, 31).since(before) == fabric.TcpSegments(2000, 3, 0)
    # A kernel that keeps no duplicate count: every resend counts as lost.
    assert fabric.tcp_segments(tmp_path / "snmp", tmp_path / "absent").lost == 37
    (tmp_path / "bad").write_text("Tcp: OutSegs\nTcp: x\n")
    assert fabric.tcp_segments(tmp_path / "bad") is None and fabric.tcp_segments(tmp_path / "absent") is None
    assert fabric.tcp_segments() is not None  # this machine's own namespace
