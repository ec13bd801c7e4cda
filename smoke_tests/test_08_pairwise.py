"""Pairwise bandwidth: every pair of local GPUs (a matrix, as nvbandwidth prints it) against the pair's NVML link,
and every pair of nodes (round-robin, then suspects re-paired with nodes that passed), so that a slow GPU pair, node
or link is named rather than a slow job; between nodes also a lossy one (TCP's retransmissions while they exchange).
Nothing is named from one measurement: suspects and slow pairs are measured again first. stackproof/measure/
pairwise.py measures on a schedule; stackproof/judge/pairwise.py decides."""

import dataclasses

import pytest
import torch.distributed as dist

from stackproof.judge import bars, data
from stackproof.judge import fabric as network
from stackproof.judge import pairwise as blame
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, FULL, Needs
from stackproof.measure import fabric, pairwise, patterns, topology
from stackproof.run import faults

MiB = 1 << 20
# Measured everywhere, judged where a bar holds the pairs (NVML link peaks, --min-pair-gbps, a spec's rate).
NO_BAR = "no bar may hold the pairs: CPU ranks, links without a peak"


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
    sweeps = pairwise.sweeps_of(dist_env.device, settings.iters)

    def measure(peer, sweep):
        return pairwise.exchange(peer, nbytes, dist_env.device, settings.warmup if sweep == 0 else 0,
                                 settings.iters // sweeps, settings.timeout,
                                 faults.pair_slow_down(settings, dist_env, peer))

    done = pairwise.run_rounds(rounds, me, rank_of, measure,
                               lambda: dist.barrier(device_ids=[dist_env.device.index] if dist_env.is_gpu else None),
                               sweeps)
    return [ex.__dict__ for ex in done]


def _own_figure(report, exchanges, nbytes) -> None:
    """This rank's slowest exchange, into its own figures (report.json's rank_figures says who)."""
    times = [ex["seconds"] for ex in exchanges]
    if times:
        worst = None if None in times else nbytes / max(times) / pairwise.GB
        report.figure("slowest_exchange", "no answer" if worst is None else round(worst, 3), "GB/s")


def _links(dist_env) -> dict | None:
    """This node's GPU pairs and the links NVML says they have, with each one's peak (judge/bars.py), by 'i,j'
    (local rank 0 reads them for its node)."""
    if not dist_env.is_gpu or dist_env.local_rank != 0:
        return None
    try:
        gpus = topology.visible(topology.inventory(), topology.cuda_visible_devices())
        return {f"{i},{j}": dataclasses.asdict(bars.pair_link(pair))
                for (i, j), pair in topology.pair_readings(gpus).items()}
    except topology.NvmlUnavailable as err:
        return {"error": str(err)}


def _judged(dist_env, settings, exchanges, verdict, also: str = "") -> Judged:
    """Each rank judges what it received itself (no agreement needed): a wrong byte is a finding on the link
    from its sender, with where it was and what it held. Every rank the verdict names fails with the same
    finding (judge/pairwise.py's blamed). With neither, pairs that had no bar to be held to are skipped."""
    gpu = dist_env.gpu_index
    found = [data.wrong_bytes("send/recv", f"{_nbytes(settings, dist_env)} B from rank {ex['peer']} to rank "
                              f"{dist_env.rank}", patterns.WrongBytes(**ex["wrong"]), gpu)
             for ex in exchanges if ex.get("wrong")]
    if dist_env.rank in verdict["ranks"]:
        found.append(blame.blamed(verdict))
    if not found:
        _no_pass_without_a_bar(verdict, also)
    return Judged(found, hint=blame.SLOW_PAIR_FIX)


def _line_rate_bar(dist_env, settings, per_node) -> pairwise.Bar:
    """The node pairs' bar from the NICs' line rate (judge/fabric.py), on GPU ranks only: CPU ranks' exchanges
    are held back by the cores they share, not by the NIC."""
    fabrics = fabric.job_fabrics(dist_env, settings.sysfs, dist_env.node)
    if not dist_env.is_gpu:
        return pairwise.Bar(None, "CPU (gloo) ranks: no bar from the NICs' line rate")
    expect = {n: network.expectation(f, [o for m, o in fabrics.items() if m != n], None) for n, f in fabrics.items()}
    rates = {n: network.node_line_rate(f, expect[n]) for n, f in fabrics.items()}
    bar = network.node_pair_bar(rates, per_node, settings.busbw_fraction, settings.emulated_nodes)
    return pairwise.Bar(bar.value, bar.source)


@pytest.mark.check(FAST, Needs(local_ranks=2), optional=NO_BAR)
def test_local_pairs(layout, dist_env, settings, report):
    per_node = layout
    faults.stop_if_asked(settings, dist_env.rank)  # hang: its peers must name it, not wait for it
    nbytes = _nbytes(settings, dist_env)
    base = dist_env.node_rank * per_node
    tolerance = settings.pair_tolerance_on(dist_env.is_gpu)

    def local(r):
        return base + r

    first = _measure(dist_env, settings, pairwise.round_robin(per_node), dist_env.local_rank, local)
    kept = {}

    def plan(values):
        """On rank 0: the first pass judged, and per node what to measure again (judge/pairwise.py)."""
        kept["first"], rounds = blame.local_first_pass(values, per_node, nbytes, settings.busbw_fraction, tolerance,
                                                       settings.min_pair_gbps)
        return rounds

    plans = dist_env.agree({"exchanges": first, "links": _links(dist_env), "node": dist_env.node},
                           "the local pair bandwidths", plan)
    second = _measure(dist_env, settings, [[tuple(p) for p in r] for r in plans[dist_env.node_rank]],
                      dist_env.local_rank, local)
    verdict = dist_env.agree(second, "the local pair re-tests", lambda values: blame.local_verdict(
        kept["first"], values, per_node, nbytes, dist_env.is_gpu))
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
    return _judged(dist_env, settings, first + second, verdict)


@pytest.mark.check(FULL, Needs(nodes=2), optional=NO_BAR)
def test_node_pairs(layout, dist_env, settings, report):
    per_node, nodes = layout, dist_env.num_nodes
    nbytes = _nbytes(settings, dist_env)

    def rank_of(node):
        return node * per_node + dist_env.local_rank

    first = _measure(dist_env, settings, pairwise.round_robin(nodes), dist_env.node_rank, rank_of)
    line = _line_rate_bar(dist_env, settings, per_node)
    kept = {}

    def plan(values):
        kept["first"], retests = blame.node_first_pass(values, per_node, nbytes,
                                                       settings.pair_tolerance_on(dist_env.is_gpu),
                                                       settings.min_pair_gbps, line)
        return retests

    retests = dist_env.agree({"exchanges": first, "node": dist_env.node}, "the node pair bandwidths", plan)
    second = _measure(dist_env, settings, [[tuple(p) for p in r] for r in retests], dist_env.node_rank, rank_of)
    verdict = dist_env.agree(second, "the node pair re-tests",
                             lambda values: blame.node_verdict(kept["first"], values, per_node, nbytes))
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
    return _judged(dist_env, settings, first + second, verdict,
                   "; packet loss judged from TCP's counters: none" if verdict["loss_judged"] else "")


def _no_pass_without_a_bar(verdict, also: str = "") -> None:
    """Pairs that answered but had no bar to be held to were measured, not judged: SKIP, saying why. (A pair
    that never answered fails without one, in _blame.)"""
    if verdict["bar"] is None:
        pytest.skip(f"measured, not judged: no bar for the pairs ({verdict['source']}){also}")
