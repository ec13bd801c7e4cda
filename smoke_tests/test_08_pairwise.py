"""Pairwise bandwidth: every pair of local GPUs (a matrix, as nvbandwidth prints it) against the pair's NVML link,
and every pair of nodes (round-robin, then suspects re-paired with nodes that passed), so that a slow GPU pair, node
or link is named rather than a slow job. Nothing is named from one measurement: suspects and slow pairs are measured
again first. stackproof/measure/pairwise.py has the schedule and the decision."""

import pytest
import torch.distributed as dist

from stackproof.judge import data
from stackproof.measure import identity, pairwise, patterns, topology
from stackproof.run import faults
from stackproof.run.config import PAIR_TOLERANCE_GPU

MiB = 1 << 20
pytestmark = pytest.mark.multi_rank


def _nbytes(settings, dist_env) -> int:
    return settings.pair_bytes or (256 * MiB if dist_env.is_gpu else MiB)


@pytest.fixture(scope="module")
def layout(dist_env):
    """The pairs are computed from rank = node x local world + local rank (torchrun's and srun's block layout)."""
    per_node = dist_env.local_world_size
    odd = dist_env.agree([dist_env.node_rank, dist_env.local_rank, per_node], "the ranks' layout", lambda values: [
        r for r, v in enumerate(values) if v != [r // per_node, r % per_node, per_node]])
    if odd:
        pytest.skip(f"rank(s) {odd} are not laid out node by node (rank = node x {per_node} + local rank, the same "
                    "number of ranks on every node): the pairs cannot be formed; launch with a block distribution")
    return per_node


def _measure(dist_env, settings, rounds, me, rank_of):
    nbytes = _nbytes(settings, dist_env)

    def measure(peer):
        return pairwise.exchange(peer, nbytes, dist_env.device, settings.warmup, settings.iters, settings.timeout,
                                 faults.send_slow_down(settings, dist_env, peer))

    done = pairwise.run_rounds(rounds, me, rank_of, measure,
                               lambda: dist.barrier(device_ids=[dist_env.device.index] if dist_env.is_gpu else None))
    return [ex.__dict__ for ex in done]


def _own_figure(report, exchanges, nbytes) -> None:
    """This rank's slowest exchange, into its own figures (report.json's rank_figures says who)."""
    times = [ex["seconds"] for ex in exchanges]
    if times:
        worst = None if None in times else nbytes / max(times) / pairwise.GB
        report.figure("slowest_exchange", "no answer" if worst is None else round(worst, 3), "GB/s")


def _links(dist_env) -> dict | None:
    """This node's GPU pairs and their NVML links (local rank 0 reads them for its node), by 'i,j'."""
    if not dist_env.is_gpu or dist_env.local_rank != 0:
        return None
    try:
        gpus = topology.visible(topology.inventory(), topology.cuda_visible_devices())
        return {f"{i},{j}": link.__dict__ for (i, j), link in topology.pair_links(gpus).items()}
    except topology.NvmlUnavailable as err:
        return {"error": str(err)}


def _delivered_intact(report, dist_env, settings, exchanges) -> None:
    """Each rank judges what it received itself (no agreement needed): a wrong byte is a finding on the link
    from its sender, with where it was and what it held."""
    gpu = dist_env.device.index if dist_env.is_gpu else None
    wrong = [data.wrong_bytes("send/recv", f"{_nbytes(settings, dist_env)} B from rank {ex['peer']} to rank "
                              f"{dist_env.rank}", patterns.WrongBytes(**ex["wrong"]), gpu)
             for ex in exchanges if ex.get("wrong")]
    report.found(*wrong)
    assert not wrong, " | ".join(map(str, wrong))


def _blame(report, dist_env, verdict) -> None:
    """Every rank named by the verdict fails with the same message: the node table then shows where. A named node
    or GPU is to be isolated; a slow link (its two ends are in the node table too) is to be triaged."""
    report.classify("interconnect", "isolate" if verdict["members_named"] else "triage")
    report.hint("a pair below the bar: check its link (nvidia-smi nvlink -s, nvidia-smi topo -m; across nodes the "
                "NIC, cable and switch port: ibstat, perfquery) and re-run the node against a known-good one")
    if dist_env.rank in verdict["ranks"]:
        raise AssertionError("; ".join(verdict["findings"]))


def _judged(settings, dist_env) -> float | None:
    """The pair tolerance, or None: CPU ranks share the host's cores, so their pair figures are reported and judged
    only when asked (--pair-tolerance or --min-pair-gbps), as their straggler timings are."""
    if settings.pair_tolerance is not None:
        return settings.pair_tolerance
    return PAIR_TOLERANCE_GPU if dist_env.is_gpu or settings.min_pair_gbps is not None else None


NOT_JUDGED = ("CPU ranks share this host's cores: their pair figures are reported above, not judged; pass "
              "--pair-tolerance or --min-pair-gbps to judge them")


@pytest.mark.fast
def test_local_pairs(layout, dist_env, settings, report):
    per_node = layout
    if per_node < 2:
        pytest.skip("one rank per node: no pair of local GPUs (or CPU ranks) to measure")
    faults.stop_if_asked(settings, dist_env.rank)  # hang: its peers must name it, not wait for it
    nbytes = _nbytes(settings, dist_env)
    base = dist_env.node_rank * per_node
    tolerance = _judged(settings, dist_env)

    def local(r):
        return base + r

    first = _measure(dist_env, settings, pairwise.round_robin(per_node), dist_env.local_rank, local)
    kept = {}

    def plan(values):
        """First pass, on rank 0: each pair against its bar; then, per node, what to measure again before any GPU,
        pair or link is named (a suspect against a GPU that passed, every other slow pair once more)."""
        figures, rails = pairwise.pair_figures([v["exchanges"] for v in values], lambda r: r, nbytes)
        nodes = {r // per_node: values[r - r % per_node]["node"] for r in range(len(values))}
        link_of = {}
        for first_rank in (n * per_node for n in nodes):
            for key, link in (values[first_rank]["links"] or {}).items():
                if key != "error":
                    i, j = map(int, key.split(","))
                    link_of[(first_rank + i, first_rank + j)] = link
        judged = {p: link_of[p]["gbps"] * settings.busbw_fraction for p in figures if link_of.get(p, {}).get("gbps")}
        per_pair = bool(judged) and len(judged) == len(figures)
        if per_pair:  # every pair has an NVML link: each against its own bar
            bar, source = 1.0, f"{settings.busbw_fraction:g} x each pair's NVML link peak (--busbw-fraction)"
        elif tolerance is None:
            bar, source = None, NOT_JUDGED
        else:
            found = pairwise.bar_for(figures, tolerance, settings.min_pair_gbps, "rank")
            bar, source = found.gbps, found.source
        ratios = pairwise.ratios(figures, judged if per_pair else {})
        kept.update(figures=figures, rails=rails, nodes=nodes, link_of=link_of, judged=judged, ratios=ratios,
                    bar=bar, source=source, per_pair=per_pair)
        rounds = {n: [[(a - n * per_node, b - n * per_node) for a, b in r] for r in pairwise.second_pass(
            {p: g for p, g in ratios.items() if p[0] // per_node == n}, bar)] for n in nodes}
        depth = max((len(r) for r in rounds.values()), default=0)
        return [rounds[n] + [[]] * (depth - len(rounds[n])) for n in sorted(nodes)]  # every node: same barriers

    plans = dist_env.agree({"exchanges": first, "links": _links(dist_env), "node": identity.node_name()},
                           "the local pair bandwidths", plan)
    second = _measure(dist_env, settings, [[tuple(p) for p in r] for r in plans[dist_env.node_rank]],
                      dist_env.local_rank, local)

    def decide(values):
        figures, ratios, bar, nodes = kept["figures"], kept["ratios"], kept["bar"], kept["nodes"]
        judged, link_of = kept["judged"], kept["link_of"]
        again_figures, _ = pairwise.pair_figures(values, lambda r: r, nbytes)
        again = pairwise.ratios(again_figures, judged if kept["per_pair"] else {})
        verdict = pairwise.localize(ratios, again, bar)

        def gpu(r):
            return f"{'GPU' if dist_env.is_gpu else 'rank'} {r % per_node}"

        def gbps(value):
            return "no answer" if value is None else f"{value:.2f} GB/s"

        def said(p):
            link = link_of.get(p, {}).get("label") or ("CPU ranks, gloo" if not dist_env.is_gpu else "link unknown")
            bar_text = f"; bar {judged[p]:.1f} GB/s" if p in judged else f"; bar {bar:.2f} GB/s" if bar else ""
            retest = f", {gbps(again_figures[p])} again" if p in again_figures else ""
            return (f"{nodes[p[0] // per_node]}: {gpu(p[0])} <-> {gpu(p[1])} ({link}): {gbps(figures[p])}{retest}"
                    f"{bar_text}")

        def retested(m):
            return next((p for p in again_figures if m in p), None) or next(p for p in figures if m in p)

        findings = [f"{gpu(m)} of {nodes[m // per_node]}: every pair slow, and again against one that passed: "
                    f"{said(retested(m))}" for m in verdict["members"]]
        findings += [said(p) + " (slow pair)" for p in verdict["links"] + verdict["unresolved"]]
        ranks = sorted(set(verdict["members"]) | {r for p in verdict["links"] + verdict["unresolved"] for r in p})
        rows = [{"node": nodes[p[0] // per_node], "a": p[0] % per_node, "b": p[1] % per_node, "ranks": list(p),
                 "gbps": None if g is None else round(g, 3), "link": link_of.get(p, {}).get("label", ""),
                 "bar_gbps": round(judged[p], 3) if p in judged else bar, "slow": pairwise.is_slow(ratios[p], bar),
                 "retest_gbps": (None if again_figures[p] is None else round(again_figures[p], 3))
                 if p in again_figures else "not measured again", "rails": kept["rails"][p]}
                for p, g in sorted(figures.items())]
        matrices = [{"node": nodes[n], "figures": [[a % per_node, b % per_node, g] for (a, b), g in figures.items()
                                                   if a // per_node == n]} for n in sorted(nodes)]
        return {"findings": findings, "ranks": ranks, "rows": rows, "matrices": matrices, "source": kept["source"],
                "bar": bar, "members_named": bool(verdict["members"]),
                "slowest": min((g for g in figures.values() if g is not None), default=None)}

    verdict = dist_env.agree(second, "the local pair re-tests", decide)
    label = "GPU" if dist_env.is_gpu else "rank"
    for matrix in verdict["matrices"]:
        figures = {(a, b): g for a, b, g in matrix["figures"]}
        report.say("\n" + pairwise.format_matrix(
            [f"{label} {i}" for i in range(per_node)], figures,
            f"pairwise bandwidth on {matrix['node']}, {label} row <-> {label} column, {nbytes} B each way at once, "
            f"{settings.iters} iters after {settings.warmup} warm-up, GB = 1e9 B, per direction"))
    report.say(f"# bar: {verdict['source']}")
    report.table("pairwise_local", verdict["rows"])
    report.figure("pairs", len(verdict["rows"]))
    if verdict["slowest"] is not None:
        report.figure("slowest_pair", round(verdict["slowest"], 3), "GB/s")
    _own_figure(report, first, nbytes)
    _delivered_intact(report, dist_env, settings, first + second)
    _blame(report, dist_env, verdict)
    _no_pass_without_a_bar(verdict)


def test_node_pairs(layout, dist_env, settings, report):
    per_node, nodes = layout, dist_env.num_nodes
    if nodes < 2:
        pytest.skip("one node: no pair of nodes to measure")
    nbytes = _nbytes(settings, dist_env)

    def rank_of(node):
        return node * per_node + dist_env.local_rank

    first = _measure(dist_env, settings, pairwise.round_robin(nodes), dist_env.node_rank, rank_of)
    kept = {}

    def plan(values):
        figures, rails = pairwise.pair_figures([v["exchanges"] for v in values], lambda r: r // per_node, nbytes)
        tolerance = _judged(settings, dist_env)
        bar = (pairwise.bar_for(figures, tolerance, settings.min_pair_gbps, "node") if tolerance is not None
               else pairwise.Bar(None, NOT_JUDGED))
        kept.update(figures=figures, rails=rails, bar=bar, names=[values[n * per_node]["node"] for n in range(nodes)])
        return pairwise.second_pass(figures, bar.gbps)

    retests = dist_env.agree({"exchanges": first, "node": identity.node_name()}, "the node pair bandwidths", plan)
    second = _measure(dist_env, settings, [[tuple(p) for p in r] for r in retests], dist_env.node_rank, rank_of)

    def decide(values):
        again, _ = pairwise.pair_figures([v for v in values], lambda r: r // per_node, nbytes)
        figures, bar, names = kept["figures"], kept["bar"], kept["names"]
        verdict = pairwise.localize(figures, again, bar.gbps)

        def gbps(value):
            return "no answer" if value is None else f"{value:.2f} GB/s"

        findings = [f"node {names[m]}: every pairing slow ({', '.join(f'with {names[b if a == m else a]} {gbps(g)}' for (a, b), g in {**figures, **again}.items() if m in (a, b))}; bar {bar.gbps} GB/s)"  # noqa: E501
                    for m in verdict["members"]]
        findings += [f"link {names[a]} <-> {names[b]}: {gbps(figures[(a, b)])}"
                     f"{f' and {gbps(again[(a, b)])} again' if (a, b) in again else ''}, both nodes fine with others "
                     f"(bar {bar.gbps} GB/s)" for a, b in verdict["links"]]
        findings += [f"{names[a]} <-> {names[b]}: {gbps(figures[(a, b)])} (bar {bar.gbps} GB/s); no node passed "
                     "to re-test against, so a slow node and a slow link cannot be told apart" for a, b in
                     verdict["unresolved"]]
        blamed = set(verdict["members"]) | {n for p in verdict["links"] + verdict["unresolved"] for n in p}
        rows = [{"a": names[a], "b": names[b], "pass": "first", "gbps": None if g is None else round(g, 3),
                 "bar_gbps": bar.gbps, "slow": pairwise.is_slow(g, bar.gbps), "rails": kept["rails"][(a, b)]}
                for (a, b), g in sorted(figures.items())]
        rows += [{"a": names[a], "b": names[b], "pass": "retest", "gbps": None if g is None else round(g, 3),
                  "bar_gbps": bar.gbps, "slow": pairwise.is_slow(g, bar.gbps)} for (a, b), g in sorted(again.items())]
        return {"findings": findings, "ranks": [r for r in range(len(values)) if r // per_node in blamed],
                "members_named": bool(verdict["members"]),
                "rows": rows, "names": names, "figures": [[a, b, g] for (a, b), g in figures.items()],
                "bar": bar.gbps, "source": bar.source, "named_nodes": [names[m] for m in verdict["members"]],
                "named_links": [[names[a], names[b]] for a, b in verdict["links"]]}

    verdict = dist_env.agree(second, "the node pair re-tests", decide)
    report.say("\n" + pairwise.format_matrix(
        verdict["names"], {(a, b): g for a, b, g in verdict["figures"]},
        f"pairwise bandwidth between nodes, row <-> column, slowest of {per_node} rail(s) (local rank k <-> local "
        f"rank k), {nbytes} B each way at once, {settings.iters} iters after {settings.warmup} warm-up, "
        "GB = 1e9 B, per direction"))
    report.say(f"# bar: {verdict['bar']} GB/s ({verdict['source']})" if verdict["bar"] is not None
               else f"# bar: none ({verdict['source']})")
    report.table("pairwise_nodes", verdict["rows"])
    report.context("pairwise_nodes", {"bar_gbps": verdict["bar"], "source": verdict["source"],
                                      "nodes": verdict["named_nodes"], "links": verdict["named_links"]})
    if verdict["bar"] is not None:
        report.figure("bar", verdict["bar"], "GB/s")
    report.figure("node_pairs", len(verdict["figures"]))
    _own_figure(report, first, nbytes)
    _delivered_intact(report, dist_env, settings, first + second)
    _blame(report, dist_env, verdict)
    _no_pass_without_a_bar(verdict)


def _no_pass_without_a_bar(verdict) -> None:
    """Pairs that answered but had no bar to be held to were measured, not judged: SKIP, saying why. (A pair
    that never answered fails without one, in _blame.)"""
    if verdict["bar"] is None:
        pytest.skip(f"measured, not judged: no bar for the pairs ({verdict['source']})")
