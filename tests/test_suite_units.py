"""Unit tests of the suite's arithmetic and bookkeeping: bandwidth math, threshold derivation, known answers,
report writing, settings checks."""

import json
import time

import pytest
import torch

from stackproof.errors import ConfigError
from stackproof.measure import bandwidth, known_answers, topology
from stackproof.report import outputs, terminal
from stackproof.report.record import Check, Figure, Report
from stackproof.run.config import ValidateConfig

GiB, MiB = 1 << 30, 1 << 20


BUSBW_CASES = [  # (bytes, seconds, ranks, algbw, busbw): nccl-tests' PERFORMANCE.md definitions
    (GiB, 0.01, 2, 107.374, 107.374),
    (GiB, 0.01, 8, 107.374, 187.905),
    (4 * GiB, 12.5e-3, 2, 343.597, 343.597),
]


@pytest.mark.parametrize(("nbytes", "seconds", "ranks", "algbw", "busbw"), BUSBW_CASES)
def test_bandwidth_definitions(nbytes, seconds, ranks, algbw, busbw):
    assert bandwidth.algbw_gbps(nbytes, seconds) == pytest.approx(algbw, rel=1e-4)
    assert bandwidth.busbw_gbps(nbytes, seconds, ranks) == pytest.approx(busbw, rel=1e-4)


def test_sweep_doubles_from_min_to_max():
    assert bandwidth.sweep_sizes(MiB, 8 * MiB) == [MiB, 2 * MiB, 4 * MiB, 8 * MiB]
    assert len(bandwidth.sweep_sizes(MiB, 4 * GiB)) == 13


def test_table_follows_the_nccl_tests_contract():
    rows = [bandwidth.Row(MiB, MiB // 4, "float", "sum", 21.4, 49.0, 49.0)]
    lines = bandwidth.format_table(rows, "all_reduce").splitlines()
    data = [line for line in lines if not line.startswith("#")]
    assert data == ["       1048576        262144     float    sum      21.40    49.00    49.00"]
    assert "(GB/s)" in lines[2] and "(us)" in lines[2] and lines[-1].startswith("# Avg bus bandwidth")


NCCL_LOG = """vm:683:700 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
vm:683:700 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
vm:683:700 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
node2:11:12 [0] NCCL INFO Channel 00/0 : 1[0] -> 2[0] [send] via NET/IB/0/GDRDMA
"""


def test_transport_read_from_nccl_info_log(tmp_path):
    (tmp_path / "nccl.vm.683.log").write_text(NCCL_LOG)
    found = bandwidth.nccl_transports(str(tmp_path / "nccl.*.log"))
    assert found == {"P2P/CUMEM/read", "NET/IB/0/GDRDMA"}
    assert {bandwidth.transport_kind(t) for t in found} == {"P2P", "NET"}


def h200(index=0, links=18, speed=26562, gen=5, width=16):
    return topology.Gpu(index, "NVIDIA H200", f"GPU-{index}", 141 * GiB, nvlink_active=links,
                        nvlink_speed_mbps=speed, pcie_gen=gen, pcie_width=width)


def test_cuda_visible_devices_by_index_and_uuid():
    inventory = topology.Inventory("580.1", "13.0", [h200(0), h200(1), h200(2)])
    assert [g.index for g in topology.visible(inventory, "2,0")] == [2, 0]
    assert [g.index for g in topology.visible(inventory, "GPU-1")] == [1]
    assert [g.index for g in topology.visible(inventory, "1,7,2")] == [1]  # CUDA stops at the first bad entry
    assert topology.visible(inventory, "") == []


def test_first_mismatch_reports_index_and_values():
    want = torch.arange(10, dtype=torch.float32)
    found = want.clone()
    found[7] += 1
    bad = known_answers.first_mismatch(found, want)
    assert (bad.index, bad.found, bad.expected, bad.wrong) == (7, 8.0, 7.0, 1)


def _finished(checks, ranks=()):
    report = Report(ranks=list(ranks))
    report.checks, report.planned, report.complete = checks, [c.nodeid for c in checks], True
    return report


def test_report_json_junit_and_table_agree_on_the_verdict(tmp_path):
    report = _finished([
        Check("test_05_bandwidth.py::test_all_reduce_busbw", figures={"busbw": Figure(343.9, "GB/s")}),
        Check("test_02_gpus.py::test_gpu_health", "failed", message="GPU 1: 3 uncorrected ECC errors",
              hint="drain the node", failed_ranks=[1]),
        Check("test_02_gpus.py::test_every_gpu_computes", "skipped", message="needs a CUDA GPU")])
    data = json.loads(outputs.write(report, tmp_path).read_text())
    assert (data["schema"], data["verdict"], data["exit_code"]) == ("stackproof.report/2", "FAILED", 1)
    assert data["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "planned": 3, "not_run": 0}
    assert data["checks"][0]["figures"] == {"busbw": {"value": 343.9, "unit": "GB/s"}}
    table = terminal.table(report).splitlines()
    assert all(line.startswith("#") for line in table if "check" in line.split()[:2] or not line.startswith("  "))
    assert "  bandwidth::all_reduce_busbw" in table[1] and "busbw=343.9 GB/s" in table[1]
    assert "GPU 1: 3 uncorrected ECC errors -- fix: drain the node" in table[2]
    assert table[-1] == "# Verdict: FAILED (exit code 1: a check failed)"
    junit = (tmp_path / "junit.xml").read_text()
    assert 'failures="1"' in junit and 'skipped="1"' in junit and "fix: drain the node" in junit
    assert 'stackproof_check_passed{check="gpus::gpu_health"} 0' in (tmp_path / "stackproof.prom").read_text()
    assert Report.from_json(data).to_json()["checks"] == data["checks"]


def test_a_report_is_ok_only_when_complete_and_every_planned_check_ran():
    assert Report().exit_code == 4  # nothing ran
    running = _finished([Check("test_01_host.py::test_dev_shm_is_large_enough")])
    running.complete = False
    assert running.exit_code == 4 and "has not finished" in running.message
    short = _finished([Check("test_01_host.py::test_dev_shm_is_large_enough")])
    short.planned.append("test_04_collectives.py::test_barrier")
    assert short.exit_code == 4 and "1 of 2 checks never ran, from collectives::barrier" in short.message
    junit = outputs.junit(short)
    assert 'errors="1"' in junit and "never ran" in junit


IDENTITIES = [{"rank": r, "node": f"n{1 + r // 4}", "host": f"n{1 + r // 4}", "node_rank": r // 4, "local_rank": r % 4,
               "gpu": {"index": r % 4, "name": "NVIDIA H200", "uuid": f"GPU-{r}", "serial": f"S{r}",
                       "pci_bus_id": f"0000:{r:02x}:00.0"}, "problem": ""} for r in range(8)]


def test_the_report_names_the_node_and_gpu_of_a_failing_rank(tmp_path):
    report = _finished([Check("test_04_collectives.py::test_barrier"),
                        Check("test_04_collectives.py::test_all_reduce[sum-float32]", "failed",
                              message="wrong " * 100, failed_ranks=[6])], IDENTITIES)  # longer than the column
    nodes = {n["node"]: n for n in report.nodes()}
    assert nodes["n1"]["verdict"] == "PASS" and nodes["n2"]["verdict"] == "FAIL"
    assert nodes["n2"]["failed_checks"] == [{"check": "collectives::all_reduce[sum-float32]", "ranks": [6]}]
    assert [g["uuid"] for g in nodes["n2"]["gpus"]] == ["GPU-4", "GPU-5", "GPU-6", "GPU-7"]
    table = terminal.table(report)
    assert "rank 6 on n2 (GPU 2, GPU-6, serial S6, PCI 0000:06:00.0)" in table
    node_lines = [line for line in table.splitlines() if line.startswith("  n")]
    assert node_lines[0].split()[:2] == ["n1", "PASS"] and node_lines[1].split()[:2] == ["n2", "FAIL"]
    assert "collectives::all_reduce[sum-float32] (rank 6)" in node_lines[1]


def test_flag_errors_name_the_flag_not_the_field():
    with pytest.raises(ConfigError) as err:
        ValidateConfig(nproc=0, busbw_fraction=2.0)
    text = str(err.value)
    assert "--nproc: expected >= 1, found 0" in text and "--busbw-fraction: expected a fraction in (0, 1]" in text
    assert "nproc=" not in text and "reports=" not in text  # no dump of the settings object


def test_settings_travel_to_the_ranks_as_the_same_command_line():
    import argparse

    settings = ValidateConfig(expect_gpus=8, min_busbw=300.0, max_check_bytes=1 << 20, select="ddp",
                              pytest_args=("-x",))
    parser = argparse.ArgumentParser()
    ValidateConfig.add_arguments(parser)
    assert ValidateConfig.from_args(parser.parse_args(settings.to_argv())) == settings


def test_a_fault_on_a_rank_that_does_not_exist_is_bad_input():
    settings = ValidateConfig(inject_fault="crash", fault_rank=7)
    with pytest.raises(ConfigError, match="--fault-rank 7: expected a rank of this run"):
        settings.check_world(2)
    settings.check_world(8)


def test_odd_ones_out_and_joint_outcome():
    from stackproof.judge import consensus

    assert consensus.odd_ones_out(["a", "a", "b", "a"]) == [2]
    assert consensus.odd_ones_out(["a", "b"]) == [1]  # a tie: rank 0 is the reference
    joint = consensus.joint_outcome([{"outcome": "passed", "message": ""}, {"outcome": "failed", "message": "x"},
                                     {"outcome": "failed", "message": "x"}])
    assert joint == {"outcome": "failed", "ranks": [1, 2], "message": "failed on rank(s) [1, 2] of 3: x"}
    mixed = consensus.joint_outcome([{"outcome": "skipped", "message": "s"}, {"outcome": "passed", "message": ""}])
    assert mixed["outcome"] == "failed" and "ranks disagree" in mixed["message"]


def test_agreement_is_one_answer_from_rank_0_and_names_missing_ranks():
    import datetime
    import threading

    import torch.distributed as tdist

    from stackproof.errors import RankTimeout
    from stackproof.run.dist import DistEnv

    server = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client():
        return tdist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))

    envs = [DistEnv(rank, 4, client(), timeout_s=2.0) for rank in range(4)]
    answers = {}

    def rank_main(env, value):
        try:
            answers[env.rank] = env.agree(value, "a test", lambda values: sorted(values))
        except RankTimeout as err:
            answers[env.rank] = str(err)

    threads = [threading.Thread(target=rank_main, args=(env, 10 - env.rank)) for env in envs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert answers == {r: [7, 8, 9, 10] for r in range(4)}
    # Rank 3 never arrives: every other rank hears rank 0 name it.
    threads = [threading.Thread(target=rank_main, args=(env, 0)) for env in envs[:3]]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all("rank(s) [3] did not finish a test within 2 s" in answers[r] for r in range(3))


def test_shards_are_proven_disjoint_and_covering_from_summaries():
    from stackproof.judge import training as judged_training
    from stackproof.measure import training

    size = 40
    good = [list(range(r, size, 4)) for r in range(4)]
    assert judged_training.shards_problem([training.shard_summary(s, size) for s in good], size) == ""
    overlap = [good[0], good[1], good[2], [*good[3][:-1], 0]]  # rank 3 holds 0 (rank 0's) instead of 39
    summaries = [training.shard_summary(s, size) for s in overlap]
    assert "overlap or miss" in judged_training.shards_problem(summaries, size)
    short = [good[0], good[1], good[2], good[3][:-1]]
    assert "expected 40" in judged_training.shards_problem([training.shard_summary(s, size) for s in short], size)
    assert training.SyntheticImages(size, 8)[5][0].equal(training.SyntheticImages(size, 8)[5][0])


def test_pins_read_an_images_env_only_inside_a_validation_layer():
    from stackproof.measure import pins

    env = {"PYTORCH_VERSION": "2.11.0", "NV_LIBNCCL_PACKAGE_VERSION": "2.28.9-1+cuda13.0"}
    assert pins.expected(None, None, env).versions == {}  # a host's CUDNN_VERSION may name a lib torch never loads
    declared = pins.expected(None, None, env, declared_env=True)
    assert declared.versions == {"torch": "2.11.0", "nccl": "2.28.9"}
    assert declared.undeclared == ["python", "torchvision", "cuda", "cudnn"]
    assert "torch=2.11.0" in declared.source


@pytest.mark.parametrize(("component", "expected", "found", "same"), [
    ("torch", "2.14.1", "2.14.1+cu130", True), ("cuda", "13.0", "13.0", True), ("cudnn", "9.24.0.43", "9.24.0", True),
    ("nccl", "2.30.7", "2.28.9", False), ("python", "3.13", "3.13", True), ("torch", "2.14.1", None, False),
    ("nccl", "2.28", "2.28.0", True), ("torch", "2.9.0", "2.9.0a0+git1234", False)])
def test_runtime_versions_compare_as_far_as_the_runtime_can_tell(component, expected, found, same):
    from stackproof.judge import pins

    assert pins.same_version(component, expected, found) is same


def test_watchdog_tells_a_rank_waiting_in_a_collective_from_one_stalled_elsewhere():
    import threading

    from stackproof.run import watchdog

    # The main thread blocks in join() here, outside torch.distributed and outside the suite's own code.
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(position=watchdog.main_thread_position()))
    thread.start()
    thread.join()
    assert seen["position"] == (False, "unknown")

    # Inside stackproof's cross-rank sync (a store wait) it counts as waiting, located in dist.py.
    from stackproof.run import dist

    class SlowStore:
        def set(self, key, value):
            pass

        def wait(self, keys, timeout):
            other = threading.Thread(target=lambda: seen.update(position=watchdog.main_thread_position()))
            other.start()
            other.join()

        def get(self, key):
            return b"null"

        def multi_get(self, keys):
            return [b"null" for _ in keys]

    env = dist.DistEnv(0, 2, SlowStore(), 5.0)  # rank 0 of two: it waits for rank 1 in the store
    env.barrier("a test")
    waiting, where = seen["position"]
    assert waiting and where.startswith("dist.py:") and where.endswith("in _decide")


def test_watchdog_does_not_blame_a_rank_passing_from_one_collective_to_the_next():
    """A rank whose collective timed out a moment before the watchdog fired is outside any collective at the first
    look (pytest reports the failure), then waits in the next (the plugin's agreement): waiting, not stalled. Its
    stalled peer is outside one at every look. (CI, two workers on 2 cores: one look blamed both ranks once.)"""
    import threading

    from stackproof.run import dist, watchdog

    seen = {}

    class Store:  # the next collective: stackproof's sync, blocked until the look is done
        def set(self, key, value):
            pass

        def wait(self, keys, timeout):
            looked.wait(10)

        def get(self, key):
            return b"null"

        def multi_get(self, keys):
            return [b"null" for _ in keys]

    looked = threading.Event()

    def look():
        seen["position"] = watchdog.position_over(2.0)
        looked.set()

    thread = threading.Thread(target=look)
    thread.start()
    time.sleep(0.3)  # outside any collective at the first look: the main thread is here
    dist.DistEnv(0, 2, Store(), 5.0).barrier("the next check's agreement")
    thread.join()
    waiting, where = seen["position"]
    assert waiting and where.endswith("in _decide"), seen

    started = time.monotonic()
    thread = threading.Thread(target=lambda: seen.update(position=watchdog.position_over(0.5)))
    thread.start()
    thread.join()  # the main thread stays outside any collective: stalled, after every look
    assert seen["position"] == (False, "unknown") and time.monotonic() - started >= 0.5


def test_watchdog_message_names_stalled_silent_and_waiting_ranks():
    from stackproof.run.watchdog import stall_message

    answers = {0: {"waiting": True, "where": "test_04_collectives.py:48 in test_barrier"},
               1: {"waiting": False, "where": "faults.py:19 in stop_if_asked"}}
    message = stall_message("test_04_collectives.py::test_barrier", 310, 3, answers)
    assert message.startswith("test_04_collectives.py::test_barrier did not finish within 310 s: ")
    assert "rank(s) [1] stalled outside any collective (rank 1 at faults.py:19 in stop_if_asked)" in message
    assert "rank(s) [2] did not answer" in message
    assert "rank(s) [0] were waiting for rank(s) [1, 2] in a collective" in message
    everyone_waits = stall_message("x::y", 310, 2, {r: {"waiting": True, "where": "dist.py:1 in _decide"}
                                                    for r in (0, 1)})
    assert "rank(s) [0, 1] were all waiting inside a collective, none stalled outside one" in everyone_waits
    assert "for them" not in everyone_waits


def test_watchdog_does_not_take_a_checkout_named_stackproof_for_the_suite(tmp_path):
    """Frames are the suite's by the package's own directory, not by a 'stackproof/' substring in the path."""
    import importlib.util
    import threading

    from stackproof.run import watchdog

    other = tmp_path / "stackproof" / ".venv" / "lib" / "elsewhere.py"
    other.parent.mkdir(parents=True)
    other.write_text("def block(probe):\n    probe()\n")
    spec = importlib.util.spec_from_file_location("elsewhere", other)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}

    def probe():
        thread = threading.Thread(target=lambda: seen.update(position=watchdog.main_thread_position()))
        thread.start()
        thread.join()

    module.block(probe)
    assert seen["position"] == (False, "unknown")  # before: (False, "elsewhere.py:2 in block")


def test_the_pins_judge_names_each_component_its_library_and_the_locks_drift():
    """judge/pins.py from recorded readings: what ran against what was promised, where a library came from, a lock."""
    from stackproof.judge import pins

    [nccl] = pins.versions({"torch": "2.11.0", "nccl": "2.30.7"}, "--expect-file e.json",
                           {"torch": "2.11.0+cu130", "nccl": "2.28.9"}, {"nccl": "/usr/lib/libnccl.so.2"})
    assert (nccl.check, nccl.category) == ("nccl", "software-pins")
    assert nccl.found == "2.28.9 loaded from /usr/lib/libnccl.so.2"
    assert pins.from_its_wheel("nccl", "nvidia-nccl-cu13", "2.28.9", "2.28.9", "/v/site-packages/nvidia/lib") == []
    [system] = pins.from_its_wheel("nccl", "nvidia-nccl-cu13", "2.28.9", "2.21.5", "/usr/lib/libnccl.so.2")
    assert system.found == "2.21.5 loaded from /usr/lib/libnccl.so.2"
    [absent] = pins.from_its_wheel("cudnn", "nvidia-cudnn-cu13", "9.19.0", None, None)
    assert "not loaded by torch at all" in absent.found
    [drift] = pins.lock_drift({f"p{i}": "1" for i in range(12)}, {"p0": "2"}, "/etc/stackproof/lock.txt")
    assert drift.found.startswith("12 package(s) differ: p0: lock 1, installed 2; p1: lock 1, installed none")
    assert drift.found.count(";") == pins.SHOWN - 1
    assert pins.lock_drift({"a": "1"}, {"a": "1"}, "l") == [] and pins.system_nccl("2.28.9", "p", "2.28.9") == []
