"""Which GPU pair, node or link is slow, decided: the pairwise pass's figures (stackproof/measure/pairwise.py
measures them) turned into bars, a second pass, and names. Pure functions, unit-tested without torch
(tests/test_localize_units.py, tests/test_judge_pairwise.py).

Decision: a pair is slow below the bar; the bar is `--min-pair-gbps` (or the NVML link's peak x --busbw-fraction
inside a node; across nodes, the NICs' line rate per rail x --busbw-fraction: judge/fabric.py), else the reference
minus --pair-tolerance, where the reference is the median over members of each member's best pair. (Not the
median of all pairs: on 3 nodes a bad node is in 2 of the 3 pairs and would drag the median down to its own
level; a member's best pair is slow only when the member itself is.) Across nodes with both a line-rate bar and a
reference, the higher of the two holds. A member whose every pair is slow is a suspect; a second pass re-pairs
each suspect with a member that passed, and measures every other slow pair again. A suspect slow again is named
(the node, or the GPU); a slow pair whose members are both fine elsewhere, slow again, is named as a link. A
suspect fine in its re-test is not named, nor are its slow pairs (its own slowness then explains them); with no
member that passed, every slow pair is measured again. Nothing is named from one measurement, inside a node as
across nodes.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stackproof.judge.findings import Finding

GB = 1e9
Pair = tuple[int, int]

# Packet loss, from TCP's own counters (gloo and NCCL's socket transport ride TCP): a pair whose segments had to be
# sent again because they were lost (resent less those the peer reports it already had: measure/fabric.py) past
# LOSSY_SHARE of all it sent, ACKs included, lost packets on the way. A healthy link stays well under 0.1 % (clean
# veth pairs on a loaded 2-core host: at most 0.24 %); 10 % loss each way on a link read 3.4-5.9 %. Fewer than
# LOSSY_MIN_SEGMENTS resent is a burst, not a link.
LOSSY_SHARE = 0.005
LOSSY_MIN_SEGMENTS = 10
# What localize() judges for loss: the share of segments delivered the first time (higher is better, as GB/s).
DELIVERED_BAR = 1 - LOSSY_SHARE

NOT_JUDGED = ("CPU ranks share this host's cores: their pair figures are reported above, not judged; pass "
              "--pair-tolerance or --min-pair-gbps to judge them")


# --- the second pass's schedule -----------------------------------------------------------------------------

def retest_rounds(suspects: Sequence[int], passing: Sequence[int]) -> list[list[Pair]]:
    """The second pass: each suspect paired with a member that passed, as rounds of disjoint pairs (a passing
    member serves one suspect per round). Empty when nobody passed: then nothing can be told apart."""
    if not passing:
        return []
    rounds: list[list[Pair]] = []
    for start in range(0, len(suspects), len(passing)):
        chunk = suspects[start:start + len(passing)]
        rounds.append(sorted((min(s, p), max(s, p)) for s, p in zip(chunk, passing, strict=False)))
    return rounds


def pack_rounds(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """These pairs as few rounds of disjoint pairs as a greedy pass finds (the second pass's slow links)."""
    rounds: list[list[Pair]] = []
    for pair in sorted(pairs):
        home = next((r for r in rounds if not {m for p in r for m in p} & set(pair)), None)
        if home is None:
            rounds.append(home := [])
        home.append(pair)
    return rounds


def second_pass(figures: dict[Pair, float | None], bar: float | None) -> list[list[Pair]]:
    """What the second pass measures: each suspect against a member that passed, then every other slow pair again
    (a link is named only if it is slow twice: one slow measurement on a busy host is not a broken link). When no
    member passed, every slow pair is measured again: nothing is named from one measurement."""
    accused, passing = suspects(figures, bar)
    if not passing:
        return pack_rounds([p for p, g in figures.items() if is_slow(g, bar)])
    links = [p for p, g in figures.items() if is_slow(g, bar) and not set(p) & set(accused)]
    return retest_rounds(accused, passing) + pack_rounds(links)



# --- the decision --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bar:
    gbps: float | None
    source: str


def reference_gbps(figures: dict[Pair, float | None]) -> float | None:
    """Median over members of each member's best pair (None: a pair that never answered)."""
    best: dict[int, float] = {}
    for (a, b), gbps in figures.items():
        for member in (a, b):
            if gbps is not None:
                best[member] = max(best.get(member, 0.0), gbps)
    return statistics.median(best.values()) if best else None


def bar_for(figures: dict[Pair, float | None], tolerance: float, override: float | None, what: str) -> Bar:
    if override is not None:
        return Bar(override, "--min-pair-gbps")
    reference = reference_gbps(figures)
    if reference is None:
        return Bar(None, "no pair answered")
    if len({m for pair in figures for m in pair}) < 3:
        return Bar(None, f"2 {what}s: one pair is its own reference; pass --min-pair-gbps to judge it")
    return Bar(round(reference * (1 - tolerance), 3),
               f"{1 - tolerance:g} x {reference:.3f} GB/s (median over {what}s of each one's best pair; "
               "--pair-tolerance)")


def ratios(figures: dict[Pair, float | None], bars: dict[Pair, float]) -> dict[Pair, float | None]:
    """Each pair's figure as a fraction of its own bar (pairs judged each against its NVML link), or the figures
    as they are when there is no bar per pair."""
    if not bars:
        return dict(figures)
    return {p: None if g is None else g / bars[p] for p, g in figures.items()}


def is_slow(gbps: float | None, bar: float | None) -> bool:
    return gbps is None or (bar is not None and gbps < bar)


def suspects(figures: dict[Pair, float | None], bar: float | None) -> tuple[list[int], list[int]]:
    """(members whose every pair was slow, the others: members that passed at least once)."""
    members = sorted({m for pair in figures for m in pair})
    accused = [m for m in members if all(is_slow(g, bar) for pair, g in figures.items() if m in pair)]
    return accused, [m for m in members if m not in accused]


def localize(figures: dict[Pair, float | None], retests: dict[Pair, float | None], bar: float | None) -> dict:
    """The verdict from the first pass (every pair) and the second (each suspect against a member that passed):
    {"members": [named: every pair slow, the re-test too], "links": [slow pairs not explained by a named member],
    "unresolved": [slow pairs of suspects nobody could re-test: with no member that passed, a slow member and a
    slow link cannot be told apart], "silent": [pairs that never answered]}. A slow pair measured again in the
    second pass (second_pass) and fine there is not named, and neither is a slow pair of a suspect that was fine
    against a member that passed (that member's slowness, then, explains the pair)."""
    accused, passing = suspects(figures, bar)
    retested = {m: [g for pair, g in retests.items() if m in pair and set(pair) - {m} <= set(passing)]
                for m in accused}
    members = [m for m in accused if retested[m] and all(is_slow(g, bar) for g in retested[m])]
    cleared = {m for m in accused if retested[m] and m not in members}
    links, unresolved = [], []
    for pair, gbps in sorted(figures.items()):
        if not is_slow(gbps, bar) or set(members) & set(pair) or cleared & set(pair):
            continue
        if pair in retests and not is_slow(retests[pair], bar):
            continue  # slow once, fine when measured again
        (unresolved if any(m in accused and not retested[m] for m in pair) else links).append(pair)
    return {"members": members, "links": links, "unresolved": unresolved,
            "silent": sorted(pair for pair, gbps in {**figures, **retests}.items() if gbps is None)}



def pair_figures(exchanges_by_rank: Sequence[Sequence[dict]], member_of: Callable[[int], int],
                 nbytes: int) -> tuple[dict[Pair, float | None], dict[Pair, list[dict]]]:
    """Every rank's exchanges ({"peer", "seconds", "error"}) -> per member pair, the bandwidth of its slowest rank
    pair (None if any rank pair never answered), and the rank pairs behind it (rails)."""
    rails: dict[Pair, dict[tuple[int, int], dict]] = {}
    for rank, exchanges in enumerate(exchanges_by_rank):
        for ex in exchanges:
            a, b = member_of(rank), member_of(ex["peer"])
            if a == b:
                continue
            pair, ranks = (min(a, b), max(a, b)), (min(rank, ex["peer"]), max(rank, ex["peer"]))
            entry = rails.setdefault(pair, {}).setdefault(ranks, {"ranks": list(ranks), "seconds": 0.0,
                                                                  "error": ""})
            if ex["seconds"] is None or entry["seconds"] is None:
                entry["seconds"], entry["error"] = None, entry["error"] or ex.get("error", "") or "no answer"
            else:
                entry["seconds"] = max(entry["seconds"], ex["seconds"])
    figures: dict[Pair, float | None] = {}
    by_pair: dict[Pair, list[dict]] = {}
    for pair, entries in rails.items():
        rows = [{**e, "gbps": None if e["seconds"] is None else nbytes / e["seconds"] / GB} for e in entries.values()]
        by_pair[pair] = sorted(rows, key=lambda r: r["ranks"])
        figures[pair] = None if any(r["gbps"] is None for r in rows) else min(r["gbps"] for r in rows)
    return figures, by_pair




def pair_segments(exchanges_by_rank: Sequence[Sequence[dict]], member_of: Callable[[int], int]
                  ) -> dict[Pair, tuple[int, int]]:
    """Per member pair, the TCP segments (sent, retransmitted) while its ranks exchanged: each end's network
    namespace once (the ranks of a node share it and meet the same peer node in a round: the most one of them
    counted), both ends added. Pairs whose counters are unknown are left out."""
    ends: dict[Pair, dict[int, tuple[int, int]]] = {}
    for rank, exchanges in enumerate(exchanges_by_rank):
        for ex in exchanges:
            a, b = member_of(rank), member_of(ex["peer"])
            if a == b or ex.get("tcp_sent") is None or ex.get("tcp_retransmitted") is None:
                continue
            counted = ends.setdefault((min(a, b), max(a, b)), {})
            counted[a] = max(counted.get(a, (0, 0)), (ex["tcp_sent"], ex["tcp_retransmitted"]))
    return {pair: (sum(s for s, _ in by_end.values()), sum(r for _, r in by_end.values()))
            for pair, by_end in ends.items()}


def delivered_first_time(segments: dict[Pair, tuple[int, int]]) -> dict[Pair, float]:
    """The share of each pair's segments TCP did not send again (1.0 below LOSSY_MIN_SEGMENTS resent)."""
    return {pair: 1.0 if resent < LOSSY_MIN_SEGMENTS or not sent else 1 - resent / sent
            for pair, (sent, resent) in segments.items()}


def _resent(counts: tuple[int, int] | None) -> str:
    if counts is None:
        return "not counted"
    sent, resent = counts
    return f"{resent} of {sent} TCP segments sent again ({resent / sent:.1%})" if sent else "no TCP segment sent"


def _counted(counts: tuple[int, int] | None) -> dict[str, int] | None:
    return None if counts is None else {"sent": counts[0], "resent": counts[1]}


# --- the blame: from every rank's exchanges to the pairs, bars, findings and rows the checks report -------------

def _gbps(value: float | None) -> str:
    return "no answer" if value is None else f"{value:.2f} GB/s"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclasses.dataclass
class LocalPass:
    """The first pass over every node's local pairs, as rank 0 keeps it until the re-tests come back."""

    figures: dict[Pair, float | None]
    rails: dict[Pair, list[dict]]
    nodes: dict[int, str]  # node rank -> name
    link_of: dict[Pair, dict]  # rank pair -> its NVML link ({"gbps", "label"})
    judged: dict[Pair, float]  # rank pair -> its own bar (NVML link x fraction)
    ratios: dict[Pair, float | None]
    bar: float | None
    source: str
    per_pair: bool


def local_first_pass(values: Sequence[Mapping[str, Any]], per_node: int, nbytes: int, fraction: float,
                     tolerance: float | None, min_pair_gbps: float | None) -> tuple[LocalPass, list[list[list[Pair]]]]:
    """Every rank's {"exchanges", "links" (local rank 0's NVML pair links, by 'i,j'), "node"} -> the first pass,
    judged (each pair against its NVML link when every pair has one, else the job's reference), and per node (in
    node order) the second pass's rounds of local pairs, padded so that every node runs the same barriers."""
    figures, rails = pair_figures([v["exchanges"] for v in values], lambda r: r, nbytes)
    nodes = {r // per_node: values[r - r % per_node]["node"] for r in range(len(values))}
    link_of = {}
    for first_rank in (n * per_node for n in nodes):
        for key, link in (values[first_rank]["links"] or {}).items():
            if key != "error":
                i, j = map(int, key.split(","))
                link_of[(first_rank + i, first_rank + j)] = link
    judged = {p: link_of[p]["gbps"] * fraction for p in figures if link_of.get(p, {}).get("gbps")}
    per_pair = bool(judged) and len(judged) == len(figures)
    if per_pair:  # every pair has an NVML link: each against its own bar
        bar, source = 1.0, f"{fraction:g} x each pair's NVML link peak (--busbw-fraction)"
    elif tolerance is None:
        bar, source = None, NOT_JUDGED
    else:
        found = bar_for(figures, tolerance, min_pair_gbps, "rank")
        bar, source = found.gbps, found.source
    scaled = ratios(figures, judged if per_pair else {})
    state = LocalPass(figures, rails, nodes, link_of, judged, scaled, bar, source, per_pair)
    rounds = {n: [[(a - n * per_node, b - n * per_node) for a, b in r] for r in second_pass(
        {p: g for p, g in scaled.items() if p[0] // per_node == n}, bar)] for n in nodes}
    depth = max((len(r) for r in rounds.values()), default=0)
    return state, [rounds[n] + [[]] * (depth - len(rounds[n])) for n in sorted(nodes)]


def local_verdict(first: LocalPass, again_exchanges: Sequence[Sequence[dict]], per_node: int, nbytes: int,
                  is_gpu: bool) -> dict[str, Any]:
    """The re-tests -> {"findings": [text], "ranks": [failing], "rows", "matrices", "source", "bar",
    "members_named", "slowest"} (what the check reports and every rank fails with)."""
    again_figures, _ = pair_figures(again_exchanges, lambda r: r, nbytes)
    again = ratios(again_figures, first.judged if first.per_pair else {})
    verdict = localize(first.ratios, again, first.bar)
    label = "GPU" if is_gpu else "rank"

    def gpu(r: int) -> str:
        return f"{label} {r % per_node}"

    def said(p: Pair) -> str:
        link = first.link_of.get(p, {}).get("label") or ("link unknown" if is_gpu else "CPU ranks, gloo")
        bar_text = (f"; bar {first.judged[p]:.1f} GB/s" if p in first.judged else
                    f"; bar {first.bar:.2f} GB/s" if first.bar else "")
        retest = f", {_gbps(again_figures[p])} again" if p in again_figures else ""
        return f"{first.nodes[p[0] // per_node]}: {gpu(p[0])} <-> {gpu(p[1])} ({link}): {_gbps(first.figures[p])}" \
               f"{retest}{bar_text}"

    def retested(m: int) -> Pair:
        return next((p for p in again_figures if m in p), None) or next(p for p in first.figures if m in p)

    findings = [f"{gpu(m)} of {first.nodes[m // per_node]}: every pair slow, and again against one that passed: "
                f"{said(retested(m))}" for m in verdict["members"]]
    findings += [said(p) + " (slow pair)" for p in verdict["links"] + verdict["unresolved"]]
    ranks = sorted(set(verdict["members"]) | {r for p in verdict["links"] + verdict["unresolved"] for r in p})
    rows = [{"node": first.nodes[p[0] // per_node], "a": p[0] % per_node, "b": p[1] % per_node, "ranks": list(p),
             "gbps": _rounded(g), "link": first.link_of.get(p, {}).get("label", ""),
             "bar_gbps": round(first.judged[p], 3) if p in first.judged else first.bar,
             "slow": is_slow(first.ratios[p], first.bar),
             "retest_gbps": _rounded(again_figures[p]) if p in again_figures else "not measured again",
             "rails": first.rails[p]}
            for p, g in sorted(first.figures.items())]
    matrices = [{"node": first.nodes[n], "figures": [[a % per_node, b % per_node, g] for (a, b), g in
                                                     first.figures.items() if a // per_node == n]}
                for n in sorted(first.nodes)]
    return {"findings": findings, "ranks": ranks, "rows": rows, "matrices": matrices, "source": first.source,
            "bar": first.bar, "members_named": bool(verdict["members"]),
            "slowest": min((g for g in first.figures.values() if g is not None), default=None)}


def node_bar(figures: dict[Pair, float | None], tolerance: float | None, override: float | None,
             line: Bar) -> Bar:
    """The bar of every node pair: --min-pair-gbps; else the higher of the NICs' line-rate bar (`line`: judge/
    fabric.py node_pair_bar; None where no NIC facts, CPU ranks or emulated nodes) and the job's reference minus
    --pair-tolerance (3 nodes or more); with neither, None and why (both reasons)."""
    if override is not None:
        return Bar(override, "--min-pair-gbps")
    relative = bar_for(figures, tolerance, None, "node") if tolerance is not None else Bar(None, NOT_JUDGED)
    have = [b for b in (relative, line) if b.gbps is not None]
    if not have:
        return Bar(None, relative.source if line.source == relative.source else f"{relative.source}; {line.source}")
    best = max(have, key=lambda b: b.gbps)
    return best if len(have) == 1 else Bar(best.gbps, f"{best.source} (the higher of that and "
                                                      f"{min(have, key=lambda b: b.gbps).source})")


@dataclasses.dataclass
class NodePass:
    figures: dict[Pair, float | None]
    rails: dict[Pair, list[dict]]
    bar: Bar
    names: list[str]
    segments: dict[Pair, tuple[int, int]] = dataclasses.field(default_factory=dict)


def node_first_pass(values: Sequence[Mapping[str, Any]], per_node: int, nbytes: int, tolerance: float | None,
                    override: float | None, line: Bar) -> tuple[NodePass, list[list[Pair]]]:
    """Every rank's {"exchanges", "node"} -> the first pass over node pairs (each the slowest of its rails) and
    the second pass's rounds of node pairs: the slow pairs' and the lossy pairs' (judged whatever the bandwidth
    bar: TCP's counters do not depend on how busy the host is)."""
    nodes = len(values) // per_node
    exchanges = [v["exchanges"] for v in values]
    figures, rails = pair_figures(exchanges, lambda r: r // per_node, nbytes)
    bar = node_bar(figures, tolerance, override, line)
    segments = pair_segments(exchanges, lambda r: r // per_node)
    state = NodePass(figures, rails, bar, [values[n * per_node]["node"] for n in range(nodes)], segments)
    rounds = second_pass(figures, bar.gbps)
    return state, rounds + [r for r in second_pass(delivered_first_time(segments), DELIVERED_BAR) if r not in rounds]


def _said(named: dict, names: list[str], first: dict[Pair, Any], again: dict[Pair, Any], say: Callable[[Any], str],
          bar: str, every: str, kind: str) -> list[str]:
    """The words for what localize() named: each node (with its every pairing), link and unresolved pair."""
    def pairings(m: int) -> str:
        return ", ".join(f"with {names[b if a == m else a]} {say(g)}" for (a, b), g in {**first, **again}.items()
                         if m in (a, b))

    found = [f"node {names[m]}: {every} ({pairings(m)}; {bar})" for m in named["members"]]
    found += [f"link {names[a]} <-> {names[b]}: {say(first[(a, b)])}"
              f"{f' and {say(again[(a, b)])} again' if (a, b) in again else ''}, both nodes fine with others ({bar})"
              for a, b in named["links"]]
    found += [f"{names[a]} <-> {names[b]}: {say(first[(a, b)])} ({bar}); no node passed to re-test against, so a "
              f"{kind} node and a {kind} link cannot be told apart" for a, b in named["unresolved"]]
    return found


def node_verdict(first: NodePass, again_exchanges: Sequence[Sequence[dict]], per_node: int,
                 nbytes: int) -> dict[str, Any]:
    """The re-tests -> {"findings", "ranks" (every rank of a named node or link), "rows", "figures", "bar",
    "source", "named_nodes", "named_links", "members_named", "names"}."""
    again, _ = pair_figures(again_exchanges, lambda r: r // per_node, nbytes)
    figures, bar, names = first.figures, first.bar, first.names
    verdict = localize(figures, again, bar.gbps)
    again_segments = pair_segments(again_exchanges, lambda r: r // per_node)
    lossy = localize(delivered_first_time(first.segments), delivered_first_time(again_segments), DELIVERED_BAR)
    # A node named by either rule explains its pairs under the other (a lossy node's pairs are slow too): its
    # pairs are not named as links.
    members = sorted(set(verdict["members"]) | set(lossy["members"]))
    for rule in (verdict, lossy):
        for kind in ("links", "unresolved"):
            rule[kind] = [p for p in rule[kind] if not set(p) & set(members)]

    findings = _said(verdict, names, figures, again, _gbps, f"bar {bar.gbps} GB/s", "every pairing slow", "slow")
    findings += _said(lossy, names, first.segments, again_segments, _resent,
                      f"a pair past {LOSSY_SHARE:.1%} lost packets", "packets lost with every peer", "lossy")
    blamed = set(members) | {n for rule in (verdict, lossy) for p in rule["links"] + rule["unresolved"] for n in p}
    rows = [{"a": names[a], "b": names[b], "pass": "first", "gbps": _rounded(g), "bar_gbps": bar.gbps,
             "slow": is_slow(g, bar.gbps), "tcp_segments": _counted(first.segments.get((a, b))),
             "rails": first.rails[(a, b)]}
            for (a, b), g in sorted(figures.items())]
    rows += [{"a": names[a], "b": names[b], "pass": "retest", "gbps": _rounded(g), "bar_gbps": bar.gbps,
              "slow": is_slow(g, bar.gbps), "tcp_segments": _counted(again_segments.get((a, b)))}
             for (a, b), g in sorted(again.items())]
    links = sorted(set(verdict["links"]) | set(lossy["links"]))
    return {"findings": findings, "ranks": [r for r in range(len(again_exchanges)) if r // per_node in blamed],
            "members_named": bool(members), "rows": rows, "names": names,
            "figures": [[a, b, g] for (a, b), g in figures.items()], "bar": bar.gbps, "source": bar.source,
            "named_nodes": [names[m] for m in members], "named_links": [[names[a], names[b]] for a, b in links],
            "loss_judged": bool(first.segments)}


SLOW_PAIR_FIX = ("a pair below the bar: check its link (nvidia-smi nvlink -s, nvidia-smi topo -m; across nodes the "
                 "NIC, cable and switch port: ibstat, perfquery) and re-run the node against a known-good one")


def blamed(verdict: Mapping[str, Any]) -> Finding:
    """The finding every rank a verdict names fails with (the node table then shows where): a named node or GPU is
    to be isolated; a slow link, whose two ends are in the node table too, to be triaged."""
    return Finding(None, "", "pairwise bandwidth", "every pair at or above the bar", "; ".join(verdict["findings"]),
                   "interconnect", "isolate" if verdict["members_named"] else "triage", SLOW_PAIR_FIX)
