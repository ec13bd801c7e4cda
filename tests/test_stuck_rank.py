"""Nothing waits forever (issue 25, part 5): a rank the kernel cannot kill is named, and the run goes on. The rank
is a real process stuck in uninterruptible sleep (state D) after SIGKILL: it holds a file on a FUSE mount that
never answers the FLUSH its exit sends (tests/stuck_rank/fuse_hold.py), as a rank stuck in the GPU driver after
an XID 79 holds its GPU. Stopping the mount's server lets it die at the end."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stackproof.judge import hardware, policy
from stackproof.measure import topology
from stackproof.report import outputs
from stackproof.run import launcher, local_ranks

FUSE_HOLD = Path(__file__).parent / "stuck_rank" / "fuse_hold.py"
HOLD_THEN_SLEEP = "import sys, time; f = open(sys.argv[1]); print('holding', flush=True); time.sleep(600)"


@pytest.fixture
def held_file(tmp_path):
    """The path of a file whose holder cannot be killed (FUSE, served by a process of its own)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = subprocess.Popen([sys.executable, str(FUSE_HOLD), str(mountpoint)], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([server.stdout], [], [], 10)
    said = server.stdout.readline().strip() if ready else "no answer in 10 s"
    if said != "ready":
        server.kill()
        server.wait()
        pytest.skip(f"no FUSE mount here ({said}): the stuck rank needs /dev/fuse and CAP_SYS_ADMIN")
    yield mountpoint / "held"
    server.send_signal(signal.SIGTERM)  # aborts the connection: the stuck process finishes dying
    server.wait(timeout=10)


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(local_ranks, "KILL_GRACE_S", 0.3)
    monkeypatch.setattr(local_ranks, "KILL_WAIT_S", 0.5)


def test_a_rank_that_outlives_sigkill_is_named_and_the_run_goes_on(held_file, short_grace, tmp_path):
    started = time.monotonic()
    outcome = local_ranks.run([sys.executable, "-c", HOLD_THEN_SLEEP, str(held_file)], 1, dict(os.environ), 1.5,
                              logs=tmp_path / "logs")
    took = time.monotonic() - started
    assert outcome.timed_out and took < 1.5 + 0.3 + 3 * 0.5 + 1, took  # bounded: timeout + grace + kill waits
    assert "holding" in (tmp_path / "logs" / "rank0.log").read_text()
    (stuck,) = outcome.unkillable
    assert (stuck["rank"], stuck["state"]) == (0, "D"), stuck
    assert stuck["wchan"] != "n/a"
    pid = stuck["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert Path(f"/proc/{pid}").exists()  # SIGKILL, again: still there
    finding = hardware.unkillable(stuck["rank"], pid, stuck["state"], stuck["wchan"], 0, "GPU-x")
    assert (finding.category, finding.severity, policy.of(finding)) == ("gpu-hardware", "reset", policy.DRAIN)
    assert f"pid {pid}" in finding.found and "state D" in finding.found


def test_ranks_that_die_are_not_named(short_grace):
    outcome = local_ranks.run([sys.executable, "-c", "import time; time.sleep(600)"], 2, dict(os.environ), 0.5)
    assert outcome.timed_out and outcome.unkillable == []


def test_the_launchers_kill_waits_a_bounded_time(held_file, short_grace):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_THEN_SLEEP, str(held_file)], stdout=subprocess.PIPE,
                            start_new_session=True, text=True)
    assert proc.stdout.readline().strip() == "holding"
    started = time.monotonic()
    stuck = launcher._kill(proc, signal.SIGTERM)
    assert time.monotonic() - started < 0.3 + 0.5 + 1
    assert stuck is not None and stuck["state"] == "D" and stuck["pid"] == proc.pid


def test_the_unkillable_rank_is_a_finding_in_the_report_on_its_gpu(tmp_path, monkeypatch):
    from stackproof.report.record import Report
    from stackproof.run.config import ValidateConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("STACKPROOF_NODE_NAME", "gpu-node-7")
    gpus = [topology.Gpu(index, "NVIDIA H200", f"GPU-{index}", 1 << 30, pci_bus_id=f"00000000:1{index}:00.0")
            for index in (0, 1)]
    settings = ValidateConfig(reports=str(tmp_path))
    found = launcher._unkillable(settings, [{"rank": 0, "pid": 4242, "state": "D", "wchan": "os_wait"}],
                                 topology.Inventory("580.159.04", "13.0", gpus))
    outputs.write(Report(findings=found, override=(4, "a rank could not be stopped"), complete=True), tmp_path)
    (finding,) = Report.load(tmp_path).findings  # the launcher's finding, as the settled record keeps it
    assert (finding.gpu_index, finding.uuid, finding.node, finding.rank, finding.pci_bus_id) == (
        1, "GPU-1", "gpu-node-7", 0, "00000000:11:00.0")  # rank 0 drives CUDA_VISIBLE_DEVICES' first GPU


def test_an_nvml_that_never_answers_ends_the_survey_at_its_deadline(monkeypatch):
    """NVML stuck in the driver: the survey's thread is left waiting and the launcher gets a verdict."""
    import pynvml

    release = threading.Event()
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", lambda: 13000)
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: "580.159.04")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: release.wait(30) and 0)
    started = time.monotonic()
    found = topology.survey("/nonexistent", deadline_s=0.3)
    assert time.monotonic() - started < 1.5
    release.set()
    assert found.gpus == [] and "did not answer within 0.3 s" in found.stalled
    finding = hardware.nvml_stalled(found.stalled)
    assert (finding.category, finding.severity, policy.of(finding)) == ("gpu-hardware", "reset", policy.DRAIN)


def test_a_stalled_survey_ends_the_run_with_a_finding_not_a_hang(tmp_path):
    import io
    import json

    from stackproof.errors import Exit
    from stackproof.run import visibility
    from stackproof.run.config import ValidateConfig

    settings = ValidateConfig(reports=str(tmp_path), pci_devices=str(tmp_path / "no-bus"))
    stalled = topology.Inventory("n/a", "n/a", [], stalled="NVML did not answer within 10 s")
    out = io.StringIO()
    assert visibility.hardware_verdict(settings, stalled, 0, out).exit_code == Exit.FAILED
    (finding,) = json.loads((tmp_path / "report.json").read_text())["findings"]
    assert (finding["check"], finding["category"]) == ("NVML answers", "gpu-hardware")
    assert "NVML did not answer within 10 s" in out.getvalue()


def test_a_rank_the_kernel_could_not_kill_after_rank_0s_verdict_turns_the_run_red_and_drains(tmp_path):
    """Rank 0 wrote a passing verdict, then a rank could not be stopped (NCCL's teardown stuck after an XID 79):
    the launcher's finding is the run's, so the settled run fails (before issue 33: exit 0, the node passed)."""
    from stackproof.act import decide
    from stackproof.errors import Exit
    from stackproof.report.record import Report
    from stackproof.run import settle
    from stackproof.run.config import ValidateConfig

    node = "gpu-node-7"
    passed = Report(complete=True, settings={"select": "test_x"}, planned=["test_01_host.py::test_x"],
                    ranks=[{"rank": 0, "node": node, "host": "h", "node_rank": 0, "local_rank": 0, "gpu": None}],
                    world={"size": 1, "nodes": 1, "backend": "gloo", "local_world_size": 1})
    passed.check("test_01_host.py::test_x").outcome = "passed"
    assert passed.exit_code == Exit.OK
    outputs.write(passed, tmp_path)
    gpus = [topology.Gpu(0, "NVIDIA H200", "GPU-0", 1 << 30, pci_bus_id="00000000:10:00.0")]
    found = launcher._unkillable(ValidateConfig(reports=str(tmp_path), node_name=node),
                                 [{"rank": 0, "pid": 4242, "state": "D", "wchan": "os_wait"}],
                                 topology.Inventory("580.159.04", "13.0", gpus))
    settled = settle.settle(tmp_path, launcher_exit=0, findings=found)
    assert settled.exit_code == Exit.FAILED and "the run found: " in settled.message, settled.message
    assert Report.load(tmp_path).exit_code == Exit.FAILED  # as written, for `stackproof act` later
    decision = decide.decide(settled)
    assert [(a.node, a.action) for a in decision.actions] == [(node, policy.DRAIN)], decision


def test_torchruns_agent_the_kernel_cannot_kill_is_kept_as_a_finding(held_file, short_grace, tmp_path):
    """The multi-node path (torchrun's agent): --run-timeout stops it, and an agent SIGKILL cannot end (it holds a
    file on the mount that never answers) is the run's finding, as on the single-node path (before issue 33,
    _kill's record was dropped)."""
    from stackproof.run.config import ValidateConfig

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\n_held = open(os.environ['HOLD_FILE'])\n")
    settings = ValidateConfig(reports=str(tmp_path / "r"), run_timeout=2, timeout=2, node_name="n5")
    env = {**os.environ, "HOLD_FILE": str(held_file),
           "PYTHONPATH": f"{site}:{Path(__file__).resolve().parents[1]}"}
    started = time.monotonic()
    rc, interrupted, timed_out, stuck = launcher._torchrun(settings, 1, env)
    assert (rc, interrupted, timed_out) == (-1, None, True)
    assert time.monotonic() - started < 2 + 0.3 + 0.5 + 2
    (agent,) = stuck  # its state as the kernel has it then: D in the FUSE wait, or S/Z on kernels that differ
    assert agent["pid"] > 0 and agent["state"], agent
    (finding,) = launcher._unkillable(settings, stuck, None)
    assert (finding.node, finding.category, policy.of(finding)) == ("n5", "gpu-hardware", policy.DRAIN)
