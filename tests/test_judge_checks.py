"""The judge steps the suite's checks return (each check's `Judged`), from recorded readings, without torch or a
GPU: the GPU-only checks' rules (GPU visibility, the driver, the memory test's coverage, NCCL's transport) are
proven here, and with a real run on a GPU by tests/gpu/round.sh."""

from stackproof.judge import (
    baseline,
    data,
    expectation,
    fabric,
    hardware,
    parallel_groups,
    per_gpu,
    software,
    stragglers,
    training,
    transformer,
)
from stackproof.judge.bars import Bar
from stackproof.judge.findings import Judged
from stackproof.judge.policy import of as action_of

MiB, GiB = 1 << 20, 1 << 30


def classes(findings):
    return [(f.category, f.severity) for f in findings]


def test_gpus_the_node_lost_drain_it_and_a_launch_that_asked_for_more_is_said():
    bus = expectation.Expected(8, expectation.BUS, "8 NVIDIA GPUs on the PCI bus")
    [lost] = expectation.seen_findings(bus, 7, 7, 7, 8, None)
    assert classes([lost]) == [("gpu-hardware", "isolate")] and action_of(lost) == "drain"
    flag = expectation.Expected(8, expectation.FLAG, "--expect-gpus 8")
    [fewer] = expectation.seen_findings(flag, 4, 4, 4, 4, "0,1,2,3", ["0000:9a:00.0"])
    assert classes([fewer]) == [("configuration", "triage")] and action_of(fewer) == "alert"
    assert fewer.expected == ">= 8 GPU(s) (--expect-gpus 8)"
    assert fewer.found == "4; on the bus but not to NVML: 0000:9a:00.0"
    [disagree] = expectation.seen_findings(flag, 8, 7, 8, 8, "0-7")
    assert "NVML's 7 visible (CUDA_VISIBLE_DEVICES=0-7, NVML total 8)" in disagree.expected and disagree.found == "8"
    assert expectation.seen_findings(flag, 8, 8, 8, 8, None) == []


def test_a_driver_of_an_older_cuda_major_is_a_finding_and_a_minor_behind_a_note():
    assert software.driver_too_old("13.0", "13.0", "580.1", "fix") == []
    assert software.driver_too_old("13.0", "12.9", "575.5", "fix")[0].found == "driver 575.5 supports CUDA 12.9 at most"
    assert software.minor_version_compatible("12.8", "12.6") and not software.minor_version_compatible("12.6", "12.8")
    assert not software.minor_version_compatible("13.0", "12.9")  # another major: the finding, not the note


def test_a_memory_test_that_took_less_than_half_the_free_memory_is_said_not_passed():
    assert per_gpu.memtest_short(0, "GPU-a", 100 * GiB, 140 * GiB, 256 * MiB) == []
    [short] = per_gpu.memtest_short(0, "GPU-a", 60 * GiB, 140 * GiB, 256 * MiB)
    assert classes([short]) == [("configuration", "triage")]
    assert short.found.startswith("60.0 GiB (the allocator's pieces are smaller than 256 MiB")


def test_nccls_transport_on_one_node():
    assert classes(fabric.local_transport_findings([], [], False, 1, "/r/nccl.%h.%p")) == [("configuration",
                                                                                           "triage")]
    [avoided] = fabric.local_transport_findings(["SHM/direct/direct"], ["SHM"], True, 1, "log")
    assert avoided.found == "SHM/direct/direct" and avoided.action == fabric.P2P_FIX
    assert fabric.local_transport_findings(["P2P/CUMEM"], ["P2P"], True, 1, "log") == []
    assert fabric.local_transport_findings(["SHM/direct/direct"], ["SHM"], False, 1, "log") == []


class Mismatch:  # measure/known_answers.py's reading of a first wrong element
    index, found, expected, wrong = 15, 256.0, 258.0, 3


def test_wrong_values_name_the_element_and_the_rank_it_came_from():
    [finding] = Judged([data.wrong_values("collective", "rank 0, op sum, count 1024 (2048 B)", Mismatch, 0)]).findings
    assert finding.expected == "rank 0, op sum, count 1024 (2048 B) delivered intact (index 15: 258.0)"
    assert finding.found == "index 15: 256.0 (3 element(s) wrong)" and classes([finding]) == [("interconnect",
                                                                                               "isolate")]
    gathered = data.wrong_values("collective", "all_gather", Mismatch, None, "index 15 (from rank 1)")
    assert gathered.found.startswith("index 15 (from rank 1): 256.0")


def test_each_checks_finding_has_the_class_its_fault_deserves():
    """What was the declaration's `fails_as` is now each judge step's own class (and fix)."""
    late = stragglers.late("all_reduce", {"found": 0.012, "reference": 0.010, "ratio": 1.2}, 0.1, None)
    assert late.found == "12.0 ms, 20% above it" and "+10%" in late.expected
    made = {
        "shm": hardware.shm_too_small(64 * MiB, 1024 * MiB),
        "parallel group": [parallel_groups.wrong_on_group("tp", [0, 1], 1, [(f"all_reduce {n}", Mismatch, 4097)
                                                                             for n in "abcd"], None)],
        "transformer": [transformer.step_wrong(0, "ddp", "bfloat16", ["gradient of w: row 3 off"], 0)],
        "ddp step": training.step_off(1, 0.1, ["0.weight"], {}, None),
        "ddp disagree": [training.disagrees("gradients", 1, None, "digest a, rank 0 has b")],
        "shards": training.shards_wrong(["overlap"], reshuffled=False),
        "loss": training.loss_wrong([2.0, float("nan")], None),
        "compile": [software.compile_failed("C++", "cpu", "CalledProcessError: g++ not found", "install g++")],
        "compiled": [software.compiled_differs(2, 3, "Mismatched elements: 1 / 64", None)],
        "baseline": baseline.worse_findings(["bandwidth::all_reduce_busbw busbw@1MiB: found 1 GB/s"], None),
        "busbw": per_gpu.below_bar(None, "", "all_reduce busbw at 1 B", 10.0, Bar(20.0, "NVLink"), 1,
                                   "GB/s", "fix", digits=1),
        "computes": [per_gpu.computes_wrong(0, "GPU-a", "a float32 matmul", "3 of 9 elements differ")],
    }
    assert {name: classes(found) for name, found in made.items()} == {
        "shm": [("configuration", "triage")], "parallel group": [("interconnect", "triage")],
        "transformer": [("software-pins", "triage")], "ddp step": [("software-pins", "triage")],
        "ddp disagree": [("interconnect", "triage")], "shards": [("software-pins", "triage")] * 2,
        "loss": [("software-pins", "triage")], "compile": [("software-pins", "triage")],
        "compiled": [("software-pins", "triage")], "baseline": [("performance", "triage")],
        "busbw": [("performance", "triage")], "computes": [("gpu-hardware", "isolate")]}
    assert made["parallel group"][0].found.startswith("all_reduce a: 3 of 4097 elements wrong, first at index 15: "
                                                      "found 256.0, expected 258.0; all_reduce b: ")
    assert made["parallel group"][0].found.endswith("(and 1 more)")
    assert made["ddp step"][0].found.startswith("after DDP's start-up broadcast, 1 tensors still differ")
    assert training.loss_wrong([2.0, 1.5], None) == [] and training.shards_wrong(["", ""], True) == []
    assert hardware.shm_too_small(8 * GiB, 1024 * MiB) == []
    assert made["busbw"][0].expected == ">= 20.0 GB/s (NVLink)" and made["busbw"][0].found == "10.0 GB/s"


def test_a_ddp_step_is_judged_from_each_tensors_worst_element_against_its_bound():
    """measure/training.py's Off per tensor: only tensors with elements beyond their bound are named."""
    from types import SimpleNamespace as Off

    within = Off(ratio=0.4, beyond=0, count=9, index=0, found=1.0, expected=1.0, bound=1e-6)
    beyond = Off(ratio=3.0, beyond=2, count=9, index=4, found=0.5, expected=0.25, bound=1e-6)
    assert training.step_off(0, 0.1, [], {"parameter a": within}, None) == []
    [off] = training.step_off(0, 0.1, [], {"parameter a": within, "buffer 1.running_mean": beyond}, 0)
    assert off.found == ("buffer 1.running_mean: 2 of 9 elements off, worst at flat index 4: found 0.5, expected "
                         "0.25 +- 1e-06")
