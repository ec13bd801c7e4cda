"""An NVLink counts as present only when it is wired (issue 25, part 4): NVML names its far end (remote PCI info),
or the node's other GPUs of the same model have that link up. Two H100 PCIe cards without a bridge answer
DISABLED for all 18 link slots (tests/fixtures/nvml/h100-pcie-no-bridge.json): green, not "NVLink down" and a
drain on every run (cf. NVIDIA/NVSentinel#1481). Replayed beneath stackproof; no GPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from replay_support import replayed_gpus

from stackproof.judge import bars, hardware, policy
from stackproof.measure import topology

FIXTURES = Path(__file__).parent / "fixtures"
PCIE_CARDS = json.loads((FIXTURES / "nvml" / "h100-pcie-no-bridge.json").read_text())


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """gpus(recording): the node's GPUs as topology.inventory reads them from the replayed recording."""
    return lambda recording: replayed_gpus(monkeypatch, tmp_path, recording)


def bridged(recording: dict, up: dict[int, range], down_wired: dict[int, list[int]] = ()) -> dict:
    """The cards with a bridge: on GPU g, links `up[g]` up and wired to the other card; `down_wired[g]` down but
    still wired (NVML names the far end)."""
    recording = copy.deepcopy(recording)
    for gpu, links in up.items():
        table = recording["devices"][gpu]
        other = recording["devices"][1 - gpu]["nvmlDeviceGetPciInfo"]["[]"]["busId"]
        for link in links:
            table["nvmlDeviceGetNvLinkState"][json.dumps([link])] = 1
            table["nvmlDeviceGetNvLinkRemotePciInfo"][json.dumps([link])] = {"busId": other}
            for counter in range(4):
                table.setdefault("nvmlDeviceGetNvLinkErrorCounter", {})[json.dumps([link, counter])] = 0
        for link in dict(down_wired).get(gpu, []):
            table["nvmlDeviceGetNvLinkRemotePciInfo"][json.dumps([link])] = {"busId": other}
    return recording


def findings(node: list[topology.Gpu]):
    return [f for gpu in node for f in hardware.findings(gpu, node)]


def test_pcie_cards_without_a_bridge_have_no_nvlink_to_be_down(gpus):
    node = gpus(PCIE_CARDS)
    assert [(g.name, g.nvlink_supported, g.nvlink_active, len(g.nvlinks_unwired)) for g in node] == [
        ("NVIDIA H100 PCIe", 0, 0, 18)] * 2
    assert findings(node) == []
    assert bars.busbw_bar(node, 1, 0.5, None).source.startswith("0.5 x") and "PCIe" in bars.link_capacity(
        node[0], node)[1]


def test_a_far_end_that_answers_all_zeros_is_no_wire(gpus):
    recording = copy.deepcopy(PCIE_CARDS)
    for table in recording["devices"]:
        table["nvmlDeviceGetNvLinkRemotePciInfo"] = {'"*"': {"busId": "00000000:00:00.0"}}
    assert findings(gpus(recording)) == []


def test_a_bridged_link_down_with_its_far_end_named_is_a_finding(gpus):
    # One lane of the bridge down: both ends still name each other.
    node = gpus(bridged(PCIE_CARDS, {0: range(0, 4), 1: range(0, 4)}, down_wired={0: [4], 1: [4]}))
    assert [(f.gpu_index, f.check, f.found) for f in findings(node)] == [
        (0, "NVLink down", "link(s) 4 down (4 up)"), (1, "NVLink down", "link(s) 4 down (4 up)")]
    assert policy.of(findings(node)[0]) == policy.DRAIN


def test_a_link_its_same_model_peer_has_up_is_expected_even_without_a_far_end(gpus):
    # GPU 1's link 3 reads down and NVML names no far end; GPU 0 (same model) has link 3 up: GPU 1 lacks it.
    node = gpus(bridged(PCIE_CARDS, {0: range(0, 4), 1: range(0, 3)}))
    (finding,) = findings(node)
    assert (finding.gpu_index, finding.check, finding.found) == (1, "NVLink down", "link(s) 3 down (3 up)")
