"""A rank that dies on a fatal signal (SIGSEGV, SIGABRT, SIGBUS, ...) gets its GPU looked at before the verdict
(issue 33): CUDA aborts on a lost context, a GPU fallen off the bus faults mapped memory. Before, the death was
"the run did not complete" and named no machine, whatever the GPU had become. The judgement from recorded
readings; the launcher's look with a real rank killed by SIGSEGV and this host's real NVML (absent here: NVML
that answered at start-up and no longer does is itself the finding)."""

from __future__ import annotations

import os
import sys
import time

from stackproof.act import decide, policy
from stackproof.judge import hardware
from stackproof.judge import health as rules
from stackproof.measure import topology
from stackproof.run import launcher, local_ranks
from stackproof.run.config import ValidateConfig

H200 = dict(name="NVIDIA H200", memory_total_bytes=141 << 30)
GPU = topology.Gpu(0, uuid="GPU-aaaa", pci_bus_id="00000000:18:00.0", **H200)
XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=4242, GPU has fallen off the bus."


def test_a_gpu_gone_after_the_death_is_a_finding_that_drains():
    (finding,) = hardware.after_a_signal(0, "SIGSEGV", GPU, [topology.Gpu(1, uuid="GPU-bbbb", **H200)], [])
    assert (finding.check, finding.gpu_index, policy.of(finding)) == ("GPU listed by NVML", 0, policy.DRAIN)
    assert "after rank 0 died on SIGSEGV" in finding.expected


def test_a_gpu_nvml_cannot_reach_or_nvml_stuck_after_the_death_drains():
    lost = {"gpus_now": [], "unreachable_now": {0: "NVML error GPU is lost"}}
    stuck = {"gpus_now": [], "stalled_now": "NVML did not answer within 10 s"}
    for now in (lost, stuck, {"gpus_now": None}):
        (finding,) = hardware.after_a_signal(0, "SIGABRT", GPU, xid_findings=[], **now)
        assert policy.of(finding) == policy.DRAIN and "after rank 0 died on SIGABRT" in finding.found, finding


def test_an_xid_the_kernel_logged_for_the_gpu_during_the_run_is_named():
    xids = rules.xid_findings(0, GPU.uuid, rules.kernel_xids([(time.time(), XID_79)], GPU.pci_bus_id, 0.0))
    (finding,) = hardware.after_a_signal(0, "SIGBUS", GPU, [GPU], xids)
    assert finding.check == "XID 79" and policy.of(finding) == policy.DRAIN


def test_a_gpu_that_reads_as_before_names_no_machine():
    assert hardware.after_a_signal(0, "SIGSEGV", GPU, [GPU], []) == []


def test_the_launcher_looks_at_the_gpu_of_a_rank_killed_by_sigsegv(tmp_path):
    """A real rank dying on SIGSEGV; the run had started with GPU 0 (the inventory of its start); this host's NVML
    is absent now, and the kernel log (a file, --kernel-log) holds an XID 79 for that GPU since the run started."""
    started = time.time() - 1
    kernel_log = tmp_path / "kern.log"
    kernel_log.write_text(f"{XID_79}\n")  # no stamp: judged whatever the watermark
    outcome = local_ranks.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 1,
                              dict(os.environ), 60)
    assert [f["exitcode"] for f in outcome.failures] == [-11]
    settings = ValidateConfig(reports=str(tmp_path), node_name="n4", kernel_log=str(kernel_log),
                              pci_devices=str(tmp_path / "no-bus"), visible_devices="0")
    found = launcher._after_signals(settings, outcome.failures, topology.Inventory("580.159.04", "13.0", [GPU]),
                                    started, None)
    assert {f.check for f in found} == {"NVML answers", "XID 79"}, found
    assert {(f.node, f.rank, f.pci_bus_id) for f in found} == {("n4", 0, GPU.pci_bus_id)}
    assert all(f.source == "launcher: rank 0 died on SIGSEGV" for f in found)
    assert decide.node_action("n4", found).action == policy.DRAIN
    # a death by SIGTERM (the launcher's own stop) or on CPU ranks (no GPU in the inventory) looks at nothing
    assert launcher._after_signals(settings, [{"rank": 0, "exitcode": -15}], topology.Inventory(
        "580.159.04", "13.0", [GPU]), started, None) == []
    assert launcher._after_signals(settings, outcome.failures, None, started, None) == []
