"""Ranks on one GPU (judge/sharing.py): a configuration finding on a real node; by design in the emulation of
several nodes on one machine, where the GPU's figures are measured once and stragglers are weighed by ranks per
GPU (judge/stragglers.py)."""

from stackproof.judge import sharing
from stackproof.judge.stragglers import late_ranks

UUIDS = ["GPU-a", "GPU-a", "GPU-b"]
NODES = ["n1", "n1", "n2"]


def test_two_ranks_on_one_gpu_are_a_configuration_finding_on_each_of_them():
    assert sharing.holders(UUIDS) == {"GPU-a": [0, 1]}
    for rank in (0, 1):
        (finding,) = sharing.findings(UUIDS, NODES, rank, 0, emulated=False)
        assert (finding.category, finding.severity) == ("configuration", "triage")
        assert finding.found == "2 ranks on it (rank 0 on n1, rank 1 on n1)" and "--nproc-per-node" in finding.action
    assert sharing.findings(UUIDS, NODES, 2, 0, emulated=False) == []


def test_emulated_nodes_share_on_purpose_and_measure_once():
    assert all(sharing.findings(UUIDS, NODES, r, 0, emulated=True) == [] for r in range(3))
    assert [sharing.measured_by(UUIDS, r) for r in range(3)] == [0, 0, 2]
    assert sharing.shares(UUIDS) == [2, 2, 1] and sharing.shares([None, None]) == [1, 1]


def test_stragglers_are_weighed_by_the_ranks_on_their_gpu():
    seconds = [2.0, 2.0, 1.0]  # ranks 0 and 1 ran their work on one GPU at once
    assert [s["rank"] for s in late_ranks(seconds, 0.1)["slow"]] == [0, 1]
    assert late_ranks(seconds, 0.1, UUIDS)["slow"] == []


def test_ranks_on_one_gpu_are_never_each_others_reference():
    """Two emulated nodes on one H200: the GPU's time-slicing made rank 1 13 % and 32 % slower than rank 0 (a
    straggler FAIL before); ranks that share a GPU are compared only with ranks of other GPUs."""
    one_gpu = late_ranks([0.0054, 0.0061], 0.1, ["GPU-a", "GPU-a"])
    assert one_gpu["slow"] == [] and one_gpu["judged"] == []
    three = late_ranks([2.0, 2.6, 1.0], 0.1, UUIDS)  # rank 1: 1.3 s alone, 30 % above rank 2's 1.0 s
    assert [s["rank"] for s in three["slow"]] == [1] and three["judged"] == [0, 1, 2]
