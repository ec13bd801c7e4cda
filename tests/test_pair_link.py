"""A GPU pair's bar: measure/topology.py reads how the pair is linked (facts only: NVML's P2P status over NVLink, the
links counted to the peer, the PCIe path) and judge/bars.py pair_link derives the peak and its words, a pure
function of the readings. The readings come from recordings replayed beneath stackproof (tests/fixtures/nvml/): an
H200 as NVML answers it on an HGX board, and two H100 PCIe cards without a bridge; no GPU."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from replay_support import replayed_gpus

from stackproof.judge import bars
from stackproof.judge.readings import PairReading
from stackproof.measure import topology

FIXTURES = Path(__file__).parent / "fixtures"
H200 = json.loads((FIXTURES / "nvml" / "h200.json").read_text())
PCIE_CARDS = json.loads((FIXTURES / "nvml" / "h100-pcie-no-bridge.json").read_text())
NVLINK_MBPS = 26562
FIELD_NVLINK_SPEED_COMMON = 90
P2P_OK, P2P_NOT_SUPPORTED, PHB = 0, 5, 30  # NVML_P2P_STATUS_*, NVML_TOPOLOGY_HOSTBRIDGE


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """gpus(recording): the node's GPUs as topology.inventory reads them from the replayed recording."""
    return lambda recording: replayed_gpus(monkeypatch, tmp_path, recording)


def linked(recording: dict, p2p: int, ancestor: int, bridge: int = 0) -> dict:
    """The recording with NVML's answers for the pair: P2P status over NVLink, common ancestor, and with `bridge`
    links up and wired to the other card at NVLINK_MBPS each."""
    recording = copy.deepcopy(recording)
    for gpu, table in enumerate(recording["devices"]):
        table["nvmlDeviceGetP2PStatus"] = {'"*"': p2p}
        table["nvmlDeviceGetTopologyCommonAncestor"] = {'"*"': ancestor}
        other = recording["devices"][1 - gpu]["nvmlDeviceGetPciInfo"]["[]"]["busId"]
        for link in range(bridge):
            table["nvmlDeviceGetNvLinkState"][json.dumps([link])] = 1
            table["nvmlDeviceGetNvLinkRemotePciInfo"][json.dumps([link])] = {"busId": other}
            for counter in range(4):
                table.setdefault("nvmlDeviceGetNvLinkErrorCounter", {})[json.dumps([link, counter])] = 0
        if bridge:
            field = table["nvmlDeviceGetFieldValues"][json.dumps([[FIELD_NVLINK_SPEED_COMMON]])][0]
            field.update(nvmlReturn=0, valueType=1, value={**field["value"], "uiVal": NVLINK_MBPS})
    return recording


def h200_on_a_switch(gpus) -> topology.Gpu:
    """The recorded H200 with its 18 NVLinks up through an NVSwitch, at 26562 MB/s each."""
    gpu = gpus(H200)[0]
    return dataclasses.replace(gpu, nvlink_active=18, nvlink_supported=18, nvlinks_up=list(range(18)),
                               nvlink_speed_mbps=NVLINK_MBPS)


# --- The pure derivation, from recorded readings ------------------------------------------------------------------

def test_an_nvlink_pair_through_a_switch_is_held_to_the_links_the_weaker_gpu_has(gpus):
    a = h200_on_a_switch(gpus)
    b = dataclasses.replace(a, index=1, pci_bus_id="00000000:2a:00.0")
    link = bars.pair_link(PairReading(a, b, nvlink_p2p_ok=True, nvlinks_to_peer=0, common_ancestor=50))
    assert (link.kind, link.label) == ("NVLink", "NVLink 18 links x 26562 MB/s")
    assert link.gbps == pytest.approx(478.1, abs=0.05)  # the README's H200 pair: 18 x 26.562 GB/s
    # A GPU with fewer links wired sets the pair's bar; one of them down does not (links it has, not links up).
    fewer = dataclasses.replace(b, nvlink_supported=12, nvlink_active=11, nvlinks_down=[3])
    assert bars.pair_link(PairReading(a, fewer, True, 0, 50)).label == "NVLink 12 links x 26562 MB/s"
    # Wired to each other directly: the links counted to the peer, not all the GPU has.
    assert bars.pair_link(PairReading(a, b, True, 4, 50)).label == "NVLink 4 links x 26562 MB/s"


def test_an_nvlink_pair_without_a_link_speed_or_p2p_falls_back_to_pcie(gpus):
    a = h200_on_a_switch(gpus)
    no_speed = dataclasses.replace(a, index=1, nvlink_speed_mbps=0)
    assert bars.pair_link(PairReading(a, no_speed, True, 0, PHB)).label == "PCIe gen5 x16 (PHB)"
    assert bars.pair_link(PairReading(a, a, False, 0, None)).label == "PCIe gen5 x16"


def test_a_pcie_pair_is_held_to_the_slower_gpus_own_generation_and_width(gpus):
    a, b = gpus(PCIE_CARDS)
    link = bars.pair_link(PairReading(a, b, False, 0, PHB))
    assert (link.kind, link.label) == ("PCIe", "PCIe gen5 x16 (PHB)")
    assert link.gbps == pytest.approx(63.0, abs=0.05)
    gen4 = dataclasses.replace(b, pcie_gen_gpu_max=4)  # the GPU's own max, whatever the slot allows
    x8 = dataclasses.replace(a, pcie_width_gpu_max=8)
    for pair, label, gbps in (((a, gen4), "PCIe gen4 x16 (PHB)", 31.5), ((gen4, a), "PCIe gen4 x16 (PHB)", 31.5),
                              ((x8, gen4), "PCIe gen5 x8 (PHB)", 31.5), ((x8, b), "PCIe gen5 x8 (PHB)", 31.5)):
        link = bars.pair_link(PairReading(*pair, False, 0, PHB))
        assert (link.kind, link.label, round(link.gbps, 1)) == ("PCIe", label, gbps)
    # An ancestor level NVML has no word for is shown as its number.
    assert bars.pair_link(PairReading(a, b, False, 0, 60)).label == "PCIe gen5 x16 (60)"


def test_a_pair_whose_link_nvml_cannot_tell_is_unknown_and_gets_no_bar(gpus):
    a, b = gpus(PCIE_CARDS)
    blind = dataclasses.replace(b, pcie_gen=0, pcie_width=0, pcie_gen_gpu_max=None, pcie_width_gpu_max=None)
    for pair in ((a, blind), (blind, a)):
        assert bars.pair_link(PairReading(*pair, False, 0, PHB)) == bars.PairLink(
            "unknown", 0.0, "link unknown: NVML reports neither NVLink nor PCIe speed")


# --- Measured from the replayed recordings, then judged -----------------------------------------------------------

def test_two_pcie_cards_read_as_a_pcie_pair(gpus):
    node = gpus(linked(PCIE_CARDS, P2P_NOT_SUPPORTED, PHB))
    readings = topology.pair_readings(node)
    assert list(readings) == [(0, 1)]
    pair = readings[(0, 1)]
    assert (pair.nvlink_p2p_ok, pair.nvlinks_to_peer, pair.common_ancestor) == (False, 0, PHB)
    assert bars.pair_link(pair).label == "PCIe gen5 x16 (PHB)"


def test_two_bridged_cards_read_as_an_nvlink_pair_counting_the_links_between_them(gpus):
    node = gpus(linked(PCIE_CARDS, P2P_OK, PHB, bridge=4))
    pair = topology.pair_readings(node)[(0, 1)]
    assert (pair.nvlink_p2p_ok, pair.nvlinks_to_peer) == (True, 4)
    link = bars.pair_link(pair)
    assert (link.kind, link.label) == ("NVLink", "NVLink 4 links x 26562 MB/s")
    assert link.gbps == pytest.approx(4 * 26.562, rel=1e-3)
