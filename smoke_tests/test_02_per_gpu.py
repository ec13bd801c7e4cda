"""Per-GPU proof: each rank checks its own GPU (health from NVML and the kernel log, silent data corruption, HBM,
host <-> device copies, GEMM throughput, XID events during the run) against bars from what the GPU should have
(stackproof/judge), with no collective inside a measurement. The ranks agree afterwards: on the odd digest out,
and on the GPU below its model's median. These checks measure and hand over; stackproof/judge decides."""

import concurrent.futures
import dataclasses
import functools
import os
import socket
import time

import pytest
import torch

from stackproof.judge import bars, data, hardware, per_gpu, sharing
from stackproof.judge import counters as counter_rules
from stackproof.judge import health as rules
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, Needs
from stackproof.measure import counters, gpu_proof, health, memtest, patterns, topology, watermark
from stackproof.run import faults

pytestmark = pytest.mark.check(FAST, Needs(gpu=True))

HOST = socket.gethostname()
# Every GPU's figure goes into the check's line up to this many GPUs; all of them always go into report.json.
FIGURES_PER_GPU_UP_TO = 8
GiB = 1 << 30
# How long a check may wait for its host part, made ahead (0.6 s on an H200's host).
ANSWERS_S = 120.0


def _local(step):
    """This rank's own work, with its exception held: it is raised once the ranks have met at the cross-rank
    step that follows, so a rank failing alone never leaves the others waiting there."""
    try:
        return step(), None
    except Exception as err:
        return None, err


def _read_own(device: torch.device, settings, own_pids: set[int], node: str
              ) -> tuple[topology.Gpu, health.Checkup, counter_rules.CounterReading]:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    torch.zeros(1, device=device)  # this rank's context on its GPU: NVML lists it among the GPU's processes
    try:
        with topology.nvml_session() as nvml:
            try:
                handle = health.handle_of(nvml, uuid)
                index = nvml.nvmlDeviceGetIndex(handle)
            except nvml.NVMLError as err:
                raise RuntimeError(f"{HOST} {device}: NVML cannot reach the GPU with torch's UUID {uuid} ({err}); "
                                   f"fix: {hardware.unreachable(-1, str(err)).action}") from err
            gpu = topology.read_gpu(nvml, index, settings.pci_devices)
            return (gpu, health.examine(nvml, handle, gpu, own_pids, settings.kernel_log,
                                        memory=_memory(settings, node), job=settings.job),
                    counters.read(nvml, handle, gpu, settings.pci_devices))
    except topology.NvmlUnavailable as err:
        raise RuntimeError(f"{HOST} {device}: torch sees the GPU but NVML does not: {err}; fix: run the container "
                           "with NVIDIA_DRIVER_CAPABILITIES including utility (stackproof images set compute,utility)"
                           ) from err


def _memory(settings, node: str) -> watermark.Memory:
    """This node's state folder: the last look at each GPU (evidence is judged since then)."""
    return watermark.Memory(settings.health_state_dir, node)


@pytest.fixture(scope="module")
def own(dist_env, settings):
    """This rank's GPU as NVML sees it, found by the UUID torch gives its device, and its health checkup (this
    run's ranks on the node are not "other processes")."""
    ranks = dist_env.agree({"host": HOST, "pid": os.getpid()}, "the ranks' pids", decide=lambda every: every)
    own_pids = {rank["pid"] for rank in ranks if rank["host"] == HOST}
    mine, error = _local(lambda: _read_own(dist_env.device, settings, own_pids, dist_env.node))
    failed = dist_env.agree(error is not None, "reading each GPU through NVML",
                            decide=lambda failures: [rank for rank, failure in enumerate(failures) if failure])
    if error is not None:
        pytest.fail(str(error))
    if failed:
        pytest.fail(f"rank(s) {failed} could not read their GPU through NVML (see their message)")
    return mine


@pytest.fixture(scope="module")
def first_on_gpu(own, dist_env):
    """The rank that times this rank's GPU: itself, unless an earlier rank shares the GPU (judge/sharing.py):
    two ranks timing one GPU at once would each see half of it."""
    uuids = dist_env.agree(own[0].uuid, "the ranks' GPUs", lambda values: values)
    return sharing.measured_by(uuids, dist_env.rank)


def _measured_elsewhere(first_on_gpu, dist_env, report, bar: bars.Bar) -> bool:
    """True on a rank whose GPU an earlier rank measured: it passes, or skips where that rank skips for want of a
    bar (a skip must be unanimous, and the GPU was judged there), saying so in its figures;
    gpus::no_two_ranks_share_a_gpu says whether the sharing is a fault."""
    if first_on_gpu == dist_env.rank:
        return False
    report.figure("measured_by_rank", first_on_gpu)
    if bar.value is None:
        pytest.skip(f"no bar ({bar.source}); this GPU was measured by rank {first_on_gpu}, which shares it")
    return True


@pytest.fixture(scope="module")
def xid_watch(own, settings, dist_env):
    """NVML's XID events on this rank's GPU, watched from the first per-GPU check to the last. Where NVML watched
    live throughout, the watermark moves on to the end of the watch: the next look does not judge again, from
    the kernel log, the XIDs NVML already reported."""
    gpu = own[0]
    with topology.nvml_session() as nvml:
        watch = health.XidWatch(nvml, health.handle_of(nvml, gpu.uuid))
        yield watch
        if watch.live:
            _memory(settings, dist_env.node).advance(gpu.uuid, time.time())
        watch.close()


@pytest.fixture(scope="module", autouse=True)
def ahead():
    """The host's part of the GEMM digest and the exact GEMM (their fixed-seed inputs in each dtype, the exact
    product: 0.6 s on an H200's host), made in a thread of its own from the module's first check while the memory
    test and the HBM copies keep the GPU busy; test_sdc_digest reads them. The same inputs and answers, made
    earlier. (Not the copies' pinned memory: pinning takes a driver lock that GPU work beside it waits on.)"""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stackproof-ahead") as pool:
        yield {"digest": pool.submit(gpu_proof.digest_inputs), "exact": pool.submit(gpu_proof.exact_inputs)}


def _where(gpu: topology.Gpu, device: torch.device) -> str:
    return f"{HOST} GPU {gpu.index} ({device}, {gpu.uuid}, serial {gpu.serial or 'n/a'}, PCI {gpu.pci_bus_id or 'n/a'})"


def _model(device: torch.device) -> str:
    """GPUs whose GEMMs must agree bit for bit and run alike: same name and SM count (cuBLAS's guarantee)."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.multi_processor_count} SMs)"


def _every_gpu(report, dist_env, gpu: topology.Gpu, what: str, value: float, bar: bars.Bar, scale: float,
               unit: str) -> None:
    """Every rank's figure and bar, into rank 0's report (each rank measured alone; this runs after)."""
    mine = {"host": HOST, "gpu": gpu.index, "uuid": gpu.uuid, "unit": unit,
            "value": None if value is None else round(value / scale, 3),
            "bar": None if bar.value is None else round(bar.value / scale, 3), "bar_source": bar.source}
    rows = dist_env.gather(mine, f"the {what} figures")  # on rank 0; every rank's own figures reach it anyway
    if rows is None:
        report.figure(what, "n/a" if mine["value"] is None else mine["value"], unit)
        return
    report.table(f"per_gpu_{what}", rows)
    measured = {row["uuid"] for row in rows if row["value"] is not None}
    rows = [row for row in rows if row["value"] is not None or row["uuid"] not in measured]  # a shared GPU: once
    if len(rows) <= FIGURES_PER_GPU_UP_TO:
        for row in rows:
            report.figure(f"{what}@{row['host']}:{row['gpu']}", "n/a" if row["value"] is None else row["value"], unit)
    elif values := sorted(row["value"] for row in rows if row["value"] is not None):
        report.figure(f"{what}_min", values[0], unit)
        report.figure(f"{what}_max", values[-1], unit)
    report.figure(f"{what}_bar", "none" if bar.value is None else round(bar.value / scale, 3), unit)


def _counter_findings(gpu: topology.Gpu, now: counter_rules.CounterReading,
                      before: counter_rules.CounterReading | None = None) -> list:
    return counter_rules.judge(gpu.index, gpu.uuid, now, before) + [
        rules.nvml_error_finding(gpu.index, gpu.uuid, what, error) for what, error in now.errors.items()]


def test_health_history(own, xid_watch, dist_env, report):
    gpu, checkup, first = own
    found = checkup.findings + _counter_findings(gpu, first)
    shown = {**checkup.readings, **counter_rules.readings(first)}
    for name, value in shown.items():
        report.figure(name, value)
    rows = dist_env.gather({"host": HOST, "gpu": gpu.index, "uuid": gpu.uuid, **shown,
                            "findings": [dataclasses.asdict(finding) for finding in found]},
                           "the health readings")
    if rows is not None:
        report.table("per_gpu_health", rows)
    return Judged(found, where=f"{HOST}, serial {gpu.serial or 'n/a'}",
                  hint="act on each finding's fix; nvidia-smi -q on the host shows the same NVML records")


def test_memory_holds_patterns(own, first_on_gpu, dist_env, report):
    """DCGM's memory test, short: address, walking-bit and random patterns over most of the free memory."""
    gpu = own[0]
    if first_on_gpu != dist_env.rank:
        # Two ranks on one GPU (emulated nodes) would each find the other's half taken: the first tests it all.
        # gpus::no_two_ranks_share_a_gpu says whether the sharing itself is a fault.
        report.figure("tested_by_rank", first_on_gpu)
        return
    tested = memtest.run(dist_env.device, patterns.seed_of("memtest", gpu.uuid))
    report.figure("tested", round(tested.tested_bytes / GiB, 1), "GiB")
    report.figure("free", round(tested.free_bytes / GiB, 1), "GiB")
    report.figure("patterns", ",".join(memtest.PATTERNS))
    report.figure("seconds", round(tested.seconds, 3), "s")
    report.figure("allocate_seconds", round(tested.allocate_seconds, 3), "s")
    wrong = [data.wrong_bytes("memory test", f"{tested.tested_bytes} B written and read back ({bad.where()})",
                              bad.wrong, gpu.index, gpu.uuid) for bad in tested.wrong]
    return Judged(wrong or per_gpu.memtest_short(gpu.index, gpu.uuid, tested.tested_bytes, tested.free_bytes,
                                                 memtest.CHUNK_BYTES), where=_where(gpu, dist_env.device),
                  hint="run DCGM's full memory test on the GPU named (dcgmi diag -r 3) and check its remapped rows")


def _delivered(gpu: topology.Gpu, moved: list[tuple[str, str, object]]) -> list:
    """The paths whose bytes arrived wrong, as this rank's findings about its GPU or link."""
    return [data.wrong_bytes(path, what, found, gpu.index, gpu.uuid) for path, what, found in moved if found]


def test_hbm_bandwidth(own, first_on_gpu, dist_env, settings, report):
    gpu = own[0]
    bar = bars.hbm_bar(gpu, settings.hbm_fraction)
    nbytes, iters = 1 << 30, 50
    mine = first_on_gpu == dist_env.rank
    measured, error = _local(lambda: gpu_proof.device_copy_bytes_per_s(
        dist_env.device, nbytes, iters=iters, seed=patterns.seed_of("hbm", dist_env.rank, gpu.uuid))) \
        if mine else (None, None)
    rate, wrong = measured or (None, None)
    _every_gpu(report, dist_env, gpu, "hbm", rate, bar, 1e12, "TB/s")
    if _measured_elsewhere(first_on_gpu, dist_env, report, bar):
        return
    if error is not None:
        raise error
    wrong = _delivered(gpu, [("device-to-device copy", f"{nbytes} B copied {iters} times", wrong)])
    if wrong:
        return Judged(wrong, where=_where(gpu, dist_env.device))
    if bar.value is None:
        pytest.skip(f"no bar for the device copy ({rate / 1e12:.2f} TB/s measured): {bar.source}")
    return Judged(per_gpu.below_bar(gpu.index, gpu.uuid, "device-to-device copy (read + write)", rate, bar, 1e12,
                                    "TB/s", per_gpu.HBM_FIX), where=_where(gpu, dist_env.device),
                  hint=per_gpu.HBM_FIX)


def test_sdc_digest(own, dist_env, settings, report, ahead):
    """After the memory test and the HBM copies: the CPU made this check's inputs and answer meanwhile."""
    gpu = own[0]
    perturb = faults.active(settings, "sdc", dist_env.rank)
    computed, error = _local(lambda: (
        gpu_proof.exact_gemm_mismatches(dist_env.device, perturb=perturb, inputs=ahead["exact"].result(ANSWERS_S)),
        gpu_proof.digest_chain(dist_env.device, perturb=perturb, inputs=ahead["digest"].result(ANSWERS_S))))
    wrong, digest = computed or ({}, None)
    model = _model(dist_env.device)
    verdict = dist_env.agree({"model": model, "digest": digest, "exact": error is None and not any(wrong.values())},
                             "the GEMM digests", decide=per_gpu.odd_ones_out_by_model)
    if error is not None:
        raise error
    odd = {entry["rank"]: entry for entry in verdict["odd"]}
    report.figure("digest", digest[:16])
    report.figure("exact_gemm_mismatches", sum(wrong.values()))
    found = [per_gpu.computes_wrong(gpu.index, gpu.uuid, "a GEMM on integers in {-1, 0, 1} (exact in every dtype) "
                                    "against the CPU's answer", f"elements that differ: {wrong}")
             ] if any(wrong.values()) else []
    if dist_env.rank in odd:
        found.append(per_gpu.digest_disagrees(odd[dist_env.rank], gpu.index, gpu.uuid, model))
    return Judged(found, hint=per_gpu.COMPUTES_WRONG, where=_where(gpu, dist_env.device))


def test_host_device_copies(own, first_on_gpu, dist_env, settings, report):
    gpu = own[0]
    bar = bars.pcie_bar(gpu, settings.pcie_fraction)
    expected = bars.pcie_expected(gpu)  # (gen, width): the link read under load is held to it
    errors: dict[str, str] = {}
    seed = patterns.seed_of("pcie", dist_env.rank, gpu.uuid)
    placed = {}

    def buffers() -> gpu_proof.HostCopies:
        # Pinned memory from the GPU's own NUMA node, as a NUMA-bound training rank has it: DMA from the other
        # node's memory crosses the socket link, which says nothing of the GPU or its PCIe link.
        with topology.near(gpu.pci_bus_id, settings.pci_devices) as cpus:
            made = gpu_proof.HostCopies(dist_env.device, seed)
        placed["near"] = bool(cpus)
        made.prepare()  # the host's part of the data check (512 MiB written on the CPU): outside the timed turns
        return made

    copies, error = _local(buffers)
    report.figure("host_memory", "the GPU's NUMA node" if placed.get("near") else
                  "where the rank runs (sysfs names no NUMA node)")

    def measure():
        nonlocal copies
        with topology.nvml_session() as nvml:
            handle = health.handle_of(nvml, gpu.uuid)
            # An idle link drops its generation to save power: read it while the copies run over it.
            h2d, link, wrong = copies.to_device(
                during=lambda: health.pcie_link_under_load(nvml, handle, errors, expected))
        d2h = copies.to_host()
        # A copy below its bar is timed again, from fresh buffers (each try its own: the earlier ones stay held,
        # so the allocator hands none of them out again), and the best counts: the host's other work or where a
        # buffer landed can slow a copy, a narrow or down-trained link never speeds one up.
        tried = [copies]
        for _ in range(gpu_proof.COPY_TRIES - 1):
            if bar.value is None or min(h2d, d2h) >= bar.value:
                break
            copies = buffers()
            tried.append(copies)
            again, _, wrong_again = copies.to_device()
            h2d, wrong = max(h2d, again), wrong or wrong_again
            d2h = max(d2h, copies.to_host())
        placed["tries"] = len(tried)
        return h2d, d2h, link, wrong

    # The GPUs of a node may share a PCIe switch's uplink: each measures in turn, so a bar on its own link holds.
    measured = None
    for turn in range(dist_env.local_world_size):
        dist_env.barrier(f"host-device copies, turn of local rank {turn}")
        if turn == dist_env.local_rank and error is None and first_on_gpu == dist_env.rank:
            measured, error = _local(measure)
    h2d, d2h, (gen, width), wrong_h2d = measured or (None, None, (None, None), None)
    wrong_d2h, check_error = _local(copies.check_host) if measured else (None, None)
    _every_gpu(report, dist_env, gpu, "h2d", h2d, bar, 1e9, "GB/s")
    _every_gpu(report, dist_env, gpu, "d2h", d2h, bar, 1e9, "GB/s")
    if _measured_elsewhere(first_on_gpu, dist_env, report, bar):
        return
    if error is not None or check_error is not None:
        raise error or check_error
    where = _where(gpu, dist_env.device)
    wrong = _delivered(gpu, [("host-to-device copy", f"{copies.nbytes} B from pinned memory", wrong_h2d),
                             ("device-to-host copy", f"{copies.nbytes} B into pinned memory", wrong_d2h)])
    if wrong:
        return Judged(wrong, where=where)
    report.figure("copy_tries", placed.get("tries", 0))
    report.figure("pcie_under_load", f"gen{gen} x{width} (the GPU's own max gen{expected[0]} x{expected[1]})")
    downtrained = hardware.pcie_under_load(gpu, gen, width)
    found = per_gpu.unread(gpu.index, gpu.uuid, errors, "interconnect", per_gpu.COPIES_FIX)
    found += [downtrained] if downtrained else []
    for name, rate in (("host-to-device", h2d), ("device-to-host", d2h)):
        found += per_gpu.below_bar(gpu.index, gpu.uuid, f"pinned {name} copy", rate, bar, 1e9, "GB/s",
                                   per_gpu.COPIES_FIX, category="interconnect", digits=1)
    if not found and bar.value is None:
        pytest.skip(f"no bar for the copies ({h2d / 1e9:.1f} / {d2h / 1e9:.1f} GB/s measured): {bar.source}")
    return Judged(found, where=where, hint=per_gpu.COPIES_FIX)


@pytest.mark.check(FAST, Needs(gpu=True), optional="no GEMM bar for a GPU architecture without a table")
def test_gemm_throughput(own, first_on_gpu, dist_env, settings, report):
    gpu = own[0]
    props = torch.cuda.get_device_properties(dist_env.device)
    bar = bars.gemm_bar(props.multi_processor_count, gpu.max_sm_clock_mhz, (props.major, props.minor),
                        settings.gemm_fraction)
    errors: dict[str, str] = {}

    def gemm():
        with topology.nvml_session() as nvml:
            handle = health.handle_of(nvml, gpu.uuid)
            stream = torch.cuda.current_stream(dist_env.device)
            # Heat or power holding the clocks back, read again and again while the GEMMs run (the checks before
            # this one kept the GPU busy for seconds): judged, as the GPU's own finding.
            flops, (reasons, _samples) = gpu_proof.gemm_flops_per_s(
                dist_env.device, noisy_neighbour=faults.active(settings, "slow-gpu", dist_env.rank),
                during=lambda: health.clock_reasons_while_busy(nvml, handle, errors, lambda: not stream.query()))
            return flops, reasons

    measured, error = _local(gemm) if first_on_gpu == dist_env.rank else (None, None)
    flops, reasons = measured or (None, None)
    held_back = rules.clock_findings(gpu.index, gpu.uuid, reasons, "under load")
    model = _model(dist_env.device)
    verdict = dist_env.agree({"model": model, "value": flops}, "the GEMM throughputs",
                             decide=functools.partial(per_gpu.below_median_by_model, tolerance=settings.gpu_spread))
    _every_gpu(report, dist_env, gpu, "gemm_bf16", flops, bar, 1e12, "TFLOP/s")
    if _measured_elsewhere(first_on_gpu, dist_env, report, bar):
        return
    if isinstance(error, gpu_proof.WrongGemm):  # the GPU computes wrong: as silent data corruption
        return Judged([per_gpu.computes_wrong(gpu.index, gpu.uuid, "GEMM throughput's kernel", str(error))],
                      where=_where(gpu, dist_env.device), hint=per_gpu.COMPUTES_WRONG)
    if error is not None:
        raise error
    slow = {entry["rank"]: entry for entry in verdict["slow"]}
    report.figure("median", round(verdict["median"][model] / 1e12, 1), "TFLOP/s")
    report.figure("clock_event_reasons_under_load", "n/a" if reasons is None else hex(reasons))
    why = f" (clocks held back: {', '.join(f.found for f in held_back)})" if held_back else ""
    found = per_gpu.unread(gpu.index, gpu.uuid, errors, "performance", per_gpu.GEMM_FIX)
    found += held_back  # the clocks' own class
    found += per_gpu.below_bar(gpu.index, gpu.uuid, "bf16 GEMM 8192^3", flops, bar, 1e12, "TFLOP/s",
                               per_gpu.GEMM_FIX, digits=0, why=why)
    if dist_env.rank in slow:
        found.append(per_gpu.below_peers(gpu.index, gpu.uuid, "bf16 GEMM 8192^3 against the job's GPUs", flops,
                                         slow[dist_env.rank]["median"], settings.gpu_spread, model, 1e12, "TFLOP/s",
                                         per_gpu.GEMM_FIX, why=why))
    if found:
        return Judged(found, where=_where(gpu, dist_env.device), hint=per_gpu.GEMM_FIX)
    if bar.value is None:
        pytest.skip(f"no bar for the GEMM ({flops / 1e12:.0f} TFLOP/s measured, within {settings.gpu_spread:.0%} of "
                    f"the job's median): {bar.source}")


def test_no_xid_during_the_run(own, xid_watch, report):
    """NVML's XID events on this GPU since the per-GPU checks began (a short wait, never a hang)."""
    gpu = own[0]
    events = xid_watch.events()
    findings = rules.xid_findings(gpu.index, gpu.uuid, events)
    findings += [rules.nvml_error_finding(gpu.index, gpu.uuid, what, error) for what, error in xid_watch.errors.items()]
    report.figure("xid_events", ", ".join(str(e.xid) for e in events) or "none")
    return Judged(findings, where=f"{HOST}, serial {gpu.serial or 'n/a'}",
                  hint="the kernel log (dmesg) names the same XIDs with their context; act on each finding's fix")


def test_counters_during_the_run(own, settings, report):
    """The counters' climb from the first per-GPU check to the last (the copies, the memory test and the GEMMs
    ran in between): PCIe replays against the link's per-lane limit, corrected ECC errors against DCGM's rate."""
    gpu, _, first = own
    with topology.nvml_session() as nvml:
        now = counters.read(nvml, health.handle_of(nvml, gpu.uuid), gpu, settings.pci_devices)
    report.figure("seconds", round(now.seconds - first.seconds, 1), "s")
    for name in ("pcie_replays", "sbe_volatile"):
        before, after = getattr(first, name), getattr(now, name)
        report.figure(f"{name}_climb", "not supported" if None in (before, after) else after - before)
    return Judged(_counter_findings(gpu, now, first), where=f"{HOST}, serial {gpu.serial or 'n/a'}",
                  hint="act on each finding's fix; the counters climb while the GPU works, so rerun to see the rate")
