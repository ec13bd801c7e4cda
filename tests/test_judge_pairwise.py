"""The pairwise blame as pure functions (stackproof/judge/pairwise.py), from every rank's exchanges as the ranks
hand them in to the findings, rows and bars the checks report: no torch, no process group."""

from __future__ import annotations

from stackproof.judge import pairwise as blame

MB = 1_000_000  # 1 MB exchanged: seconds = 1e-3 / GB/s


def exchanges(per_rank_peers: dict[int, dict[int, float | None]], world: int) -> list[list[dict]]:
    """{rank: {peer: GB/s}} -> what each rank hands in (seconds per 1 MB exchange)."""
    return [[{"peer": peer, "seconds": None if g is None else MB / (g * 1e9), "error": ""}
             for peer, g in per_rank_peers.get(rank, {}).items()] for rank in range(world)]


def node_values(gbps: dict[tuple[int, int], float | None], nodes: int, names=None) -> list[dict]:
    """One rank per node; the first pass of `nodes` nodes with these pair figures."""
    peers: dict[int, dict[int, float | None]] = {}
    for (a, b), g in gbps.items():
        peers.setdefault(a, {})[b] = g
        peers.setdefault(b, {})[a] = g
    names = names or [f"n{i + 1}" for i in range(nodes)]
    return [{"exchanges": ex, "node": names[r]} for r, ex in enumerate(exchanges(peers, nodes))]


NONE = blame.Bar(None, "not derived across nodes: no NIC facts (sysfs class/infiniband, class/net); pass --min-busbw")


def test_a_slow_node_among_three_is_named_after_its_retest():
    figures = {(0, 1): 10.0, (0, 2): 10.0, (1, 2): 1.0}
    first, retests = blame.node_first_pass(node_values(figures, 3), 1, MB, 0.25, None, NONE)
    assert first.bar.gbps == 7.5 and "median over nodes" in first.bar.source
    assert retests == [[(1, 2)]]  # both suspects' slow pair, measured again
    again = exchanges({1: {2: 1.0}, 2: {1: 1.0}}, 3)
    verdict = blame.node_verdict(first, again, 1, MB)
    assert verdict["named_links"] == [["n2", "n3"]] and verdict["ranks"] == [1, 2]
    assert verdict["findings"] == ["link n2 <-> n3: 1.00 GB/s and 1.00 GB/s again, both nodes fine with others "
                                   "(bar 7.5 GB/s)"]


def test_a_node_slow_with_everyone_is_named_and_only_it():
    figures = {(0, 1): 10.0, (0, 2): 1.0, (1, 2): 1.0, (0, 3): 10.0, (1, 3): 10.0, (2, 3): 1.0}
    first, retests = blame.node_first_pass(node_values(figures, 4), 1, MB, 0.25, None, NONE)
    assert retests == [[(0, 2)]]  # the suspect (n3) against a node that passed
    verdict = blame.node_verdict(first, exchanges({0: {2: 1.0}, 2: {0: 1.0}}, 4), 1, MB)
    assert verdict["named_nodes"] == ["n3"] and verdict["ranks"] == [2] and verdict["members_named"]
    assert verdict["findings"][0].startswith("node n3: every pairing slow (with n1 1.00 GB/s")


def test_two_nodes_are_judged_by_the_line_rate_and_without_nics_say_so():
    figures = {(0, 1): 2.0}
    line = blame.Bar(6.25, "0.5 x 50 GB/s line rate of n1 (2 RDMA port(s) x 200 Gb/s) / 4 rails")
    first, retests = blame.node_first_pass(node_values(figures, 2), 1, MB, 0.25, None, line)
    assert first.bar == line and retests == [[(0, 1)]]  # no node passed: the slow pair again
    verdict = blame.node_verdict(first, exchanges({0: {1: 2.0}, 1: {0: 2.0}}, 2), 1, MB)
    assert "no node passed to re-test against" in verdict["findings"][0] and verdict["ranks"] == [0, 1]
    unjudged, _ = blame.node_first_pass(node_values(figures, 2), 1, MB, 0.25, None, NONE)
    assert unjudged.bar.gbps is None and "2 nodes" in unjudged.bar.source and "no NIC facts" in unjudged.bar.source


def test_the_higher_of_line_rate_and_reference_holds():
    figures = {(0, 1): 10.0, (0, 2): 10.0, (1, 2): 10.0}
    low = blame.node_bar(figures, 0.25, None, blame.Bar(5.0, "line"))
    assert low.gbps == 7.5 and low.source.endswith("(the higher of that and line)")
    high = blame.node_bar(figures, 0.25, None, blame.Bar(9.0, "line"))
    assert high.gbps == 9.0
    assert blame.node_bar(figures, 0.25, 3.0, blame.Bar(9.0, "line")) == blame.Bar(3.0, "--min-pair-gbps")
    assert blame.node_bar(figures, None, None, NONE).source.startswith(blame.NOT_JUDGED)


def test_local_pairs_against_their_nvml_links_name_the_slow_pair():
    per_node, links = 3, {"0,1": {"gbps": 100.0, "label": "NVLink"}, "0,2": {"gbps": 100.0, "label": "NVLink"},
                          "1,2": {"gbps": 100.0, "label": "NVLink"}}
    peers = {}
    for a, b in ((0, 1), (0, 2), (1, 2)):
        g = 5.0 if (a, b) == (1, 2) else 80.0
        peers.setdefault(a, {})[b] = g
        peers.setdefault(b, {})[a] = g
    values = [{"exchanges": ex, "links": links if r == 0 else None, "node": "gpu-a"}
              for r, ex in enumerate(exchanges(peers, per_node))]
    first, plans = blame.local_first_pass(values, per_node, MB, 0.5, 0.25, None)
    assert first.per_pair and first.judged[(1, 2)] == 50.0 and plans == [[[(1, 2)]]]
    verdict = blame.local_verdict(first, exchanges({1: {2: 5.0}, 2: {1: 5.0}}, per_node), per_node, MB, True)
    assert verdict["ranks"] == [1, 2] and not verdict["members_named"]
    assert verdict["findings"] == ["gpu-a: GPU 1 <-> GPU 2 (NVLink): 5.00 GB/s, 5.00 GB/s again; bar 50.0 GB/s "
                                   "(slow pair)"]
    assert [r["slow"] for r in verdict["rows"]] == [False, False, True] and verdict["slowest"] == 5.0
