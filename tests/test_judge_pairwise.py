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


# --- packet loss, from TCP's counters (each end's namespace: a lossy node resends on its sends, its peers on theirs)

def lossy_values(resent: dict[tuple[int, int], int], nodes: int, sent: int = 10_000) -> list[dict]:
    """Every pair at 10 GB/s; each end of pair (a, b) counted `sent` segments and resent[(a, b)] of them again."""
    values = node_values({(a, b): 10.0 for a in range(nodes) for b in range(a + 1, nodes)}, nodes)
    for rank, value in enumerate(values):
        for ex in value["exchanges"]:
            ex.update(tcp_sent=sent, tcp_retransmitted=resent.get((min(rank, ex["peer"]), max(rank, ex["peer"])), 0))
    return values


def test_a_lossy_node_among_three_is_named_though_no_pair_is_slow():
    """ns1 of the CI's namespaces drops 5 % of its packets each way: its two pairs resend, the third is clean;
    with no bandwidth bar at all (CPU ranks) the loss is still judged."""
    first, retests = blame.node_first_pass(lossy_values({(0, 1): 600, (1, 2): 550}, 3), 1, MB, None, None, NONE)
    assert first.bar.gbps is None and retests == [[(0, 1)]]  # the suspect against a node that delivered cleanly
    again = [[{**ex, "tcp_sent": 10_000, "tcp_retransmitted": 700} for ex in v["exchanges"]]
             for v in lossy_values({(0, 1): 700}, 3)]
    again = [[ex for ex in exs if {r, ex["peer"]} == {0, 1}] for r, exs in enumerate(again)]
    verdict = blame.node_verdict(first, again, 1, MB)
    assert verdict["named_nodes"] == ["n2"] and verdict["ranks"] == [1] and verdict["members_named"]
    (finding,) = verdict["findings"]
    assert finding.startswith("node n2: packets lost with every peer (with n1 1400 of 20000 TCP segments sent "
                              "again (7.0%), with n3 1100 of 20000"), finding  # n1's pairing as re-tested
    assert finding.endswith("; a pair past 0.5% lost packets)")
    first_rows = [row for row in verdict["rows"] if row["pass"] == "first"]
    assert [row["tcp_segments"] for row in first_rows] == [{"sent": 20000, "resent": 1200},
                                                           {"sent": 20000, "resent": 0},
                                                           {"sent": 20000, "resent": 1100}]


def test_one_lossy_link_among_four_names_the_link_and_a_clean_run_nothing():
    first, retests = blame.node_first_pass(lossy_values({(1, 3): 400}, 4), 1, MB, None, None, NONE)
    assert retests == [[(1, 3)]]
    verdict = blame.node_verdict(first, [[ex for ex in v["exchanges"] if ex["peer"] in (1, 3)] if r in (1, 3) else []
                                         for r, v in enumerate(lossy_values({(1, 3): 450}, 4))], 1, MB)
    assert verdict["named_links"] == [["n2", "n4"]] and verdict["named_nodes"] == [] and verdict["ranks"] == [1, 3]
    assert verdict["findings"] == ["link n2 <-> n4: 800 of 20000 TCP segments sent again (4.0%) and 900 of 20000 "
                                   "TCP segments sent again (4.5%) again, both nodes fine with others (a pair past "
                                   "0.5% lost packets)"]
    clean, retests = blame.node_first_pass(lossy_values({(0, 1): 9, (2, 3): 150}, 4, sent=100_000), 1, MB, None,
                                           None, NONE)
    assert retests == []  # 9 resent is a burst; 150 of 200,000 is 0.075 %: both under the bar
    assert blame.node_verdict(clean, [[]] * 4, 1, MB)["findings"] == []


def test_counters_that_could_not_be_read_judge_nothing():
    values = node_values({(0, 1): 10.0, (0, 2): 10.0, (1, 2): 10.0}, 3)
    first, _ = blame.node_first_pass(values, 1, MB, None, None, NONE)
    verdict = blame.node_verdict(first, [[]] * 3, 1, MB)
    assert first.segments == {} and not verdict["loss_judged"] and verdict["findings"] == []


def test_a_lossy_nodes_slow_pairs_are_its_own_not_links():
    """The lossy node's pairs are slower too (TCP resending): the slow rule alone would name a link of it; the node
    named for its loss explains them."""
    values = lossy_values({(0, 1): 600, (1, 2): 550}, 3)
    for rank, value in enumerate(values):
        for ex in value["exchanges"]:
            if {rank, ex["peer"]} == {0, 1}:
                ex["seconds"] *= 20  # 0.5 GB/s against 10
    first, retests = blame.node_first_pass(values, 1, MB, 0.75, None, NONE)
    assert retests == [[(0, 1)]]  # the slow pair and the lossy suspect's re-test: one exchange
    again = [[{"peer": 1 - r, "seconds": 20 * MB / 10e9, "error": "", "tcp_sent": 10_000, "tcp_retransmitted": 650}]
             if r in (0, 1) else [] for r in range(3)]
    verdict = blame.node_verdict(first, again, 1, MB)
    assert verdict["named_nodes"] == ["n2"] and verdict["named_links"] == [] and verdict["ranks"] == [1], verdict
    assert len(verdict["findings"]) == 1 and verdict["findings"][0].startswith("node n2: packets lost")
