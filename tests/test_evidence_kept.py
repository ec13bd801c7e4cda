"""A withheld drain keeps its evidence (issue 33): the health check moves each GPU's last look (the XID watermark,
the NVLink counters: measure/watermark.py) on to this run, so a drain the circuit breaker withheld would find
nothing at the next run. healthcheck puts the last looks back as they were before the run whenever a drain was
withheld or nothing was acted on; a drain done, or a pass, keeps the new look."""

from __future__ import annotations

from stackproof.act import decide, policy
from stackproof.act import run as act_run
from stackproof.judge.findings import Finding
from stackproof.measure import watermark

XID_79 = Finding(0, "GPU-aaaa", "XID 79", "no XID (kernel log)", "XID 79: fallen off the bus", "gpu-hardware",
                 "isolate", "drain", node="n2")


def _after_a_run(state, node="n2"):
    """The state as the run found it (looked at until 100), and as the run's health check leaves it (200)."""
    memory = watermark.Memory(state, node, boot="boot-1")
    memory.keep("GPU-aaaa", 100.0, {0: {"replay": 1}})
    looks = watermark.snapshot(state, node)
    memory.advance("GPU-aaaa", 200.0)
    memory.keep("GPU-bbbb", 200.0, {})  # a GPU first looked at by this run
    return memory, looks


def test_a_withheld_drain_rewinds_the_last_looks_so_the_next_run_judges_the_xid_again(tmp_path):
    memory, looks = _after_a_run(tmp_path)
    drain = decide.NodeAction("n2", policy.DRAIN, "stackproof: XID 79 GPU 0", (XID_79,))
    held = decide.Decision(decide.Exit.FAILED, "a check failed", (drain,)).hold_drains("--max-drained 1 reached")
    said = []
    act_run.keep_evidence(held, looks, tmp_path, "n2", said.append)
    assert memory.previous("GPU-aaaa").looked_at == 100.0 and memory.previous("GPU-aaaa").nvlink == {0: {"replay": 1}}
    assert memory.previous("GPU-bbbb").looked_at is None  # never looked at, as before the run
    assert said == ["evidence since the last look kept for the next run (the last looks rewound): the drain was "
                    "withheld"]


def test_a_drain_done_or_a_pass_keeps_the_new_look(tmp_path):
    memory, looks = _after_a_run(tmp_path)
    drained = decide.Decision(decide.Exit.FAILED, "a check failed",
                              (decide.NodeAction("n2", policy.DRAIN, "stackproof: XID 79 GPU 0", (XID_79,)),))
    passed = decide.Decision(decide.Exit.OK, "every check passed", (decide.NodeAction("n2", decide.PASS),))
    for done in (drained, passed):
        said = []
        act_run.keep_evidence(done, looks, tmp_path, "n2", said.append)
        assert memory.previous("GPU-aaaa").looked_at == 200.0 and said == []


def test_a_run_acted_on_for_nothing_rewinds_too(tmp_path):
    memory, looks = _after_a_run(tmp_path)
    nothing = decide.Decision(decide.Exit.INCOMPLETE, "rank 1 died", withheld="exit code 4 with no finding")
    act_run.keep_evidence(nothing, looks, tmp_path, "n2", lambda _: None)
    assert memory.previous("GPU-aaaa").looked_at == 100.0
