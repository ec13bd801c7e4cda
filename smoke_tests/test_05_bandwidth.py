"""all_reduce bandwidth sweep (nccl-tests definitions), eager and from a CUDA graph (nccl-tests -G), the
transport NCCL chose, and a pass threshold derived from the measured topology unless --min-busbw is given."""

import os

import pytest
import torch

from stackproof.judge import bars, data, per_gpu
from stackproof.judge import fabric as network
from stackproof.judge.findings import Finding, Judged
from stackproof.judge.promise import FULL, Needs
from stackproof.measure import bandwidth, fabric, topology

MiB, GiB, KiB = 1 << 20, 1 << 30, 1 << 10


@pytest.fixture(scope="module")
def sweep(dist_env, settings):
    low = settings.sweep_min or (8 if dist_env.is_gpu else 64 * KiB)
    high = settings.sweep_max or (4 * GiB if dist_env.is_gpu else 4 * MiB)
    rows, wrong = [], {}
    for size in bandwidth.sweep_sizes(low, high):
        rows.append(bandwidth.time_all_reduce(size, dist_env.world_size, dist_env.device, settings.warmup,
                                              settings.iters))
        found = bandwidth.all_reduce_known_answer(size, dist_env.rank, dist_env.world_size, dist_env.device)
        if found is not None:
            wrong[size] = found
    return rows, wrong



def _sums_wrong(dist_env, wrong: dict, what: str) -> list[Finding]:
    """This rank's wrong sums (each rank checks its own result: nothing to agree on), as findings on the
    collective's links, one per size."""
    return [data.wrong_data("collective", f"{what} of {size} B on rank {dist_env.rank} of {dist_env.world_size}",
                            *_split(bad), dist_env.gpu_index) for size, bad in sorted(wrong.items())]


def _split(bad) -> tuple[str, str, str]:
    return (f"element {bad.index} of {bad.count}", f"{bad.expected:g}",
            f"{bad.found:g} ({bad.wrong} element(s) wrong)")


@pytest.fixture(scope="module")
def gpus(dist_env):
    if not dist_env.is_gpu:
        return []
    try:
        inventory = topology.inventory()
    except topology.NvmlUnavailable:
        return []
    return topology.visible(inventory, topology.cuda_visible_devices())


@pytest.fixture(scope="module")
def fabrics(dist_env, settings):
    """{node: its NIC facts} (stackproof/measure/fabric.py), every node's, on every rank."""
    return fabric.job_fabrics(dist_env, settings.sysfs, dist_env.node)


def _network_bar(fabrics, dist_env, settings) -> bars.Bar:
    """Across nodes on GPUs: the busbw bar from the slowest node's line rate (judge/fabric.py), said in the
    report; CPU ranks' gloo figures are the shared cores', not the NIC's."""
    if dist_env.num_nodes < 2 or not dist_env.is_gpu:
        return bars.Bar(None, "one node" if dist_env.num_nodes < 2 else "CPU ranks")
    expect = {n: network.expectation(f, [o for m, o in fabrics.items() if m != n], None) for n, f in fabrics.items()}
    return network.cross_node_busbw_bar({n: network.node_line_rate(f, expect[n]) for n, f in fabrics.items()},
                                        settings.busbw_fraction, settings.emulated_nodes)


@pytest.mark.check(FULL, Needs(ranks=2), optional="no busbw bar across nodes without --min-busbw, nor on CPU ranks")
def test_all_reduce_busbw(sweep, gpus, fabrics, dist_env, settings, report):
    sweep, wrong = sweep
    threshold = bars.busbw_bar(gpus, dist_env.num_nodes, settings.busbw_fraction, settings.min_busbw,
                               _network_bar(fabrics, dist_env, settings))
    header = (f"all_reduce sum in-place, {dist_env.world_size} ranks ({dist_env.backend}), "
              f"{settings.iters} iters after {settings.warmup} warm-up, GB = 1e9 B, time = mean over ranks")
    report.say("\n" + bandwidth.format_table(sweep, header))
    report.table("all_reduce_busbw", [row.__dict__ for row in sweep])
    _figures(report, sweep)
    largest = sweep[-1]
    report.context("busbw_threshold", {"gbps": threshold.value, "source": threshold.source,
                                       "at_bytes": largest.size_bytes})
    if threshold.value is not None:
        report.figure("threshold", threshold.value, "GB/s")
    bar = f"{threshold.value} GB/s at {largest.size_bytes} B" if threshold.value is not None else "none"
    report.say(f"# threshold: {bar} ({threshold.source})")
    found = _sums_wrong(dist_env, wrong, "an all_reduce sum (the sweep's known-answer call)")
    if threshold.value is None and not found:
        pytest.skip(f"no bar to hold busbw to: {threshold.source}" if dist_env.is_gpu else
                    "CPU (gloo) run: the sweep above is measured, but no bar is derived without GPUs; "
                    "pass --min-busbw to set one")
    found += per_gpu.below_bar(dist_env.gpu_index, "", f"all_reduce busbw at {largest.size_bytes} B",
                               largest.busbw_gbps, threshold, 1, "GB/s", bars.BUSBW_FIX, digits=3)
    return Judged(found, hint=bars.BUSBW_FIX)


@pytest.mark.check(FULL, Needs(gpu=True, ranks=2), optional="a torch without CUDA-graph NCCL capture, or --graph-max 0")
def test_all_reduce_from_a_cuda_graph(dist_env, settings, report):
    """Small messages without the host in the way: the latency a training step that replays a graph sees."""
    unsupported = bandwidth.graph_unsupported(dist_env.device)
    sizes = bandwidth.sweep_sizes(settings.sweep_min or 8, min(settings.graph_max, settings.sweep_max or 4 * GiB))
    if unsupported or not sizes:
        pytest.skip(unsupported or "--graph-max 0: no CUDA-graph sweep")
    wrong = {}
    try:
        rows = []
        for size in sizes:
            rows.append(bandwidth.time_all_reduce_graph(size, dist_env.world_size, dist_env.device, settings.iters))
            found = bandwidth.graph_all_reduce_known_answer(size, dist_env.rank, dist_env.world_size,
                                                            dist_env.device)
            if found is not None:
                wrong[size] = found
    except RuntimeError as err:  # this NCCL supports capture, so a refusal is a failure; a hang is the watchdog's
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        fix = ("check the driver against the image's CUDA and that no NCCL_* setting (e.g. NCCL_GRAPH_REGISTER, "
               "NCCL_RUNTIME_CONNECT) breaks capture")
        return Judged([Finding(dist_env.gpu_index, "", "all_reduce from a CUDA graph", f"NCCL "
                               f"{'.'.join(map(str, torch.cuda.nccl.version()))} to capture it (NCCL >= 2.9.6 can)",
                               first, "configuration", "triage", fix)], hint=fix)
    report.say("\n" + bandwidth.format_table(rows, (
        f"all_reduce sum in-place from a CUDA graph ({settings.iters} per graph, {bandwidth.GRAPH_LAUNCHES} "
        f"launches), {dist_env.world_size} ranks, GB = 1e9 B, time = mean over ranks")))
    report.table("all_reduce_busbw_graph", [row.__dict__ for row in rows])
    _figures(report, rows, prefix="graph_")
    return Judged(_sums_wrong(dist_env, wrong, "an all_reduce sum replayed from a CUDA graph"))


@pytest.mark.check(FULL, Needs(gpu=True, ranks=2),
                   optional="NCCL_DEBUG set by the caller: no transport log of ours")
def test_nccl_transport(sweep, gpus, fabrics, dist_env, settings, report, nccl_log):
    sweep = sweep[0]
    log = nccl_log
    mine = sorted(bandwidth.nccl_transports(log)) if log else []
    everyone = dist_env.agree(mine, "the NCCL transport report", lambda ranks: sorted(set().union(*ranks)))
    if not log:
        pytest.skip("NCCL_DEBUG was set by the caller, so stackproof did not capture NCCL's transport log")
    kinds = sorted({bandwidth.transport_kind(t) for t in everyone})
    nvlink = bool(gpus) and all(g.nvlink_active for g in gpus)
    report.figure("transport", ",".join(everyone) or "unknown")
    report.context("nccl_transport", {"transports": everyone, "nvlink_up": nvlink, "log": os.path.dirname(log)})
    found = network.local_transport_findings(everyone, kinds, nvlink, dist_env.num_nodes, log)
    return Judged(found + _network_transport(mine, gpus, fabrics, dist_env, settings, report))


def _network_transport(mine, gpus, fabrics, dist_env, settings, report) -> list[Finding]:
    """Across nodes: this rank's NCCL network transport against its node's NICs (judge/fabric.py): sockets with
    RDMA up everywhere, or RDMA without GPUDirect where it should have it, is this rank's finding."""
    if dist_env.num_nodes < 2:
        return []
    node = dist_env.node
    nics = [p["pci_bus_id"] for p in (fabrics.get(node) or {}).get("ports", ()) if p.get("pci_bus_id")]
    bus = gpus[dist_env.device.index].pci_bus_id if dist_env.device.index < len(gpus) else None
    paths = fabric.gpu_nic_paths(settings.sysfs, [bus], nics) if bus and nics else {}
    if dist_env.is_main:
        report.context("gpu_nic_paths", paths)
    report.figure("network", ",".join(t for t in mine if t.startswith("NET/")) or "none")
    return network.transport_findings(mine, dist_env.num_nodes, fabrics, node, paths, settings.emulated_nodes)


def _figures(report, rows, prefix: str = "") -> None:
    """The sizes a reader compares with nccl-tests: latency at 8 B and 512 KiB, busbw from 1 MiB up."""
    for row in rows:
        if row.size_bytes in (8, 512 * KiB):
            report.figure(f"{prefix}time@{_human(row.size_bytes)}", round(row.time_us, 2), "us")
        if row.size_bytes in (MiB, 64 * MiB, 256 * MiB, GiB, 4 * GiB) or row is rows[-1]:
            report.figure(f"{prefix}busbw@{_human(row.size_bytes)}", round(row.busbw_gbps, 1), "GB/s")


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"
