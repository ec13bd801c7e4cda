"""Evidence judged since the last look (issue 25, part 3): the kernel log's XIDs after the node's watermark, NVLink
replay/recovery counters as growth since the node's previous reading, XIDs an application causes or that no
table holds never drain, and a kernel log that could not be read is a finding (not a pass). The recorded H200
(tests/fixtures/nvml/h200.json, replayed beneath stackproof) is read for real; its kernel log is a file written
here, or a journalctl put first on PATH (a real process at the boundary). No torch, no GPU."""

from __future__ import annotations

import copy
import json
import os
import stat
import time
from pathlib import Path

import pytest
from replay_support import install_replay

from stackproof.judge import health as rules
from stackproof.judge import policy
from stackproof.measure import health, topology, watermark

FIXTURES = Path(__file__).parent / "fixtures"
RECORDING = json.loads((FIXTURES / "nvml" / "h200.json").read_text())
SYSFS = str(FIXTURES / "sysfs" / "h200-vm")
PCI = "0000:00:06"  # the recorded H200's address, as the driver prints it
REPLAY_COUNTER, RECOVERY_COUNTER = 0, 1  # NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY


@pytest.fixture
def look(monkeypatch, tmp_path):
    """look(kernel_log, memory, replays=0, recoveries=0): the recorded H200 examined, with 18 NVLinks up whose
    replay/recovery counters read as given on link 5."""
    def examine(kernel_log: str, memory: watermark.Memory | None, replays: int = 0, recoveries: int = 0):
        recording = copy.deepcopy(RECORDING)
        table = recording["devices"][0]
        table["nvmlDeviceGetNvLinkState"] = {json.dumps([link]): 1 if link < 18 else {"_error": 2}
                                             for link in range(36)}
        counters = table.setdefault("nvmlDeviceGetNvLinkErrorCounter", {})
        for link in range(18):
            for counter in range(4):
                counters[json.dumps([link, counter])] = 0
        counters[json.dumps([5, REPLAY_COUNTER])] = replays
        counters[json.dumps([5, RECOVERY_COUNTER])] = recoveries
        install_replay(monkeypatch, tmp_path, recording)
        with topology.nvml_session() as nvml:
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            gpu = topology.read_gpu(nvml, 0, SYSFS)
            return health.examine(nvml, handle, gpu, set(), kernel_log, memory=memory)
    return examine


def journal(path: Path, *records: tuple[float, str]) -> str:
    """A kernel log saved as journalctl -k -o short-unix writes it: wall-time stamps."""
    path.write_text("".join(f"{when:.6f} gpu-node-7 kernel: {text}\n" for when, text in records))
    return str(path)


def xid(number: int, words: str = "") -> str:
    return f"NVRM: Xid (PCI:{PCI}): {number}, pid=4242, name=python3, {words}"


def checks(checkup) -> list[str]:
    return [finding.check for finding in checkup.findings]


def test_an_xid_the_last_look_saw_is_not_judged_again_and_a_new_one_is(look, tmp_path):
    memory = watermark.Memory(tmp_path / "state", "gpu-node-7", boot="boot-1")
    long_ago = time.time() - 7 * 24 * 3600
    log = journal(tmp_path / "kernel.log", (long_ago, xid(79, "GPU has fallen off the bus.")))
    first = look(log, memory)
    assert checks(first) == ["XID 79"] and "logged (" in first.findings[0].found
    # The GPU was reset as the finding said; the XID is still in the ring buffer: the next look passes.
    again = look(log, memory)
    assert again.findings == [] and again.readings["xids"] == "none"
    assert again.readings["looked_at_before"] != "never (first look)"
    # A new XID, logged after that look, is judged.
    watermark_now = memory.previous(RECORDING["devices"][0]["nvmlDeviceGetUUID"]["[]"]).looked_at
    log = journal(tmp_path / "kernel.log", (long_ago, xid(79)), (watermark_now + 1, xid(48, "DBE")))
    assert checks(look(log, memory)) == ["XID 48"]


def test_without_a_state_folder_every_look_is_a_first_one(look, tmp_path):
    log = journal(tmp_path / "kernel.log", (time.time() - 3600, xid(79)))
    assert checks(look(log, None)) == checks(look(log, None)) == ["XID 79"]


def test_a_reboot_drops_the_watermark(look, tmp_path):
    state = tmp_path / "state"
    log = journal(tmp_path / "kernel.log", (time.time() - 60, xid(79)))
    assert checks(look(log, watermark.Memory(state, "n", boot="boot-1"))) == ["XID 79"]
    assert look(log, watermark.Memory(state, "n", boot="boot-1")).findings == []
    # A new boot_id: a new kernel log (and zeroed counters), so all of it is since the last look.
    assert checks(look(log, watermark.Memory(state, "n", boot="boot-2"))) == ["XID 79"]


def test_nvlink_errors_are_judged_as_growth_since_the_previous_reading(look, tmp_path):
    memory = watermark.Memory(tmp_path / "state", "gpu-node-7", boot="boot-1")
    quiet = journal(tmp_path / "kernel.log")
    # Replays counted once, months ago: the first reading only sets the baseline, later equal ones pass.
    assert look(quiet, memory, replays=7).findings == []
    assert look(quiet, memory, replays=7).findings == []
    grew = look(quiet, memory, replays=9, recoveries=1)
    assert [(f.check, f.found, f.category) for f in grew.findings] == [
        ("NVLink replay errors", "link 5: +2", "interconnect"),
        ("NVLink recovery errors", "link 5: +1", "interconnect")]
    assert grew.findings[0].expected.startswith("0 new since the last look (")
    # A GPU reset cleared the counters, and 3 replays came after it: all 3 are new.
    assert [f.found for f in look(quiet, memory, replays=3, recoveries=1).findings] == ["link 5: +3"]
    assert look(quiet, memory, replays=3, recoveries=1).findings == []


def test_a_link_down_for_a_look_keeps_its_baseline():
    before = {5: {"replay": 7, "recovery": 0}, 6: {"replay": 2}}
    now = {6: {"replay": 3, "recovery": None}}  # link 5 down now, link 6's recovery counter unanswered
    assert watermark.merged(before, now) == {5: {"replay": 7, "recovery": 0}, 6: {"replay": 3}}
    assert watermark.merged(None, now) == {6: {"replay": 3}}


def test_application_and_unknown_xids_never_drain():
    for number in (8, 13, 31, 43, 45, 109):  # the catalog's RESTART_APP: the tenant's kernel, not the GPU
        assert rules.xid_findings(0, "GPU-x", [rules.Xid(number, "kernel log")]) == [], number
    unknown = rules.xid_findings(0, "GPU-x", [rules.Xid(172, "NVML event")])
    assert [(f.category, f.severity) for f in unknown] == [("unclassified", "triage")]
    assert policy.of(unknown[0]) != policy.DRAIN and "Xid catalog" in unknown[0].action
    assert policy.of(rules.xid_findings(0, "GPU-x", [rules.Xid(79, "kernel log")])[0]) == policy.DRAIN


def fake_journalctl(bin_dir: Path, exit_code: int, stdout: str = "", stderr: str = "") -> Path:
    """A journalctl first on PATH that says what it was asked into args.txt and answers as told."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "journalctl"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {bin_dir}/args.txt\nprintf '%s' '{stdout}'\n"
                      f"printf '%s' '{stderr}' >&2\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_an_unreadable_kernel_log_is_a_finding_and_journalctl_errors_are_not_nothing_matched(look, tmp_path,
                                                                                             monkeypatch):
    missing = str(tmp_path / "no-kmsg")  # as a container without /dev/kmsg sees it
    bin_dir = fake_journalctl(tmp_path / "bin", 1, stderr="No journal files were found.")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    finding = only(look(missing, None).findings)
    assert (finding.check, finding.category, finding.severity) == ("kernel log", "tool-error", "triage")
    assert "No journal files were found" in finding.found and policy.of(finding) != policy.DRAIN
    # journalctl answering, with nothing in the log: a reading, no finding.
    fake_journalctl(tmp_path / "bin", 0)
    assert look(missing, None).findings == []
    # With a watermark, journalctl is asked only for what came after it.
    memory = watermark.Memory(tmp_path / "state", "n", boot="b")
    look(missing, memory)
    look(missing, memory)
    assert "--since=@" in (bin_dir / "args.txt").read_text().splitlines()[-1]


def test_a_log_not_read_keeps_the_watermark_where_it_was(look, tmp_path, monkeypatch):
    memory = watermark.Memory(tmp_path / "state", "n", boot="b")
    monkeypatch.setenv("PATH", f"{fake_journalctl(tmp_path / 'bin', 1, stderr='Permission denied')}"
                               f"{os.pathsep}{os.environ['PATH']}")
    look(str(tmp_path / "no-kmsg"), memory)
    log = journal(tmp_path / "kernel.log", (time.time() - 60, xid(79)))
    assert checks(look(log, memory)) == ["XID 79"]  # never looked at, so still judged


def test_a_state_folder_that_cannot_be_written_is_said(look, tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    finding = only(look(journal(tmp_path / "kernel.log"), watermark.Memory(blocked, "n", boot="b")).findings)
    assert (finding.check, finding.category) == ("health state", "configuration")


def test_a_state_file_that_cannot_be_read_is_said_once_and_replaced(look, tmp_path):
    memory = watermark.Memory(tmp_path / "state", "n", boot="b")
    uuid = RECORDING["devices"][0]["nvmlDeviceGetUUID"]["[]"]
    path = watermark.state_file(tmp_path / "state", "n", uuid)
    path.parent.mkdir(parents=True)
    path.write_text("{half a file")
    log = journal(tmp_path / "kernel.log")
    assert checks(look(log, memory)) == ["health state"]
    assert look(log, memory).findings == []


def test_the_kernel_logs_stamps_become_wall_times():
    booted = 1_764_000_000.0
    assert rules.kmsg_record("4,812,5012123456,-;NVRM: Xid (PCI:0000:00:06): 79, GPU lost\n SUBSYSTEM=pci\n",
                             booted) == (booted + 5012.123456, "NVRM: Xid (PCI:0000:00:06): 79, GPU lost")
    assert rules.timed("[ 5012.123456] NVRM: hello", booted) == (booted + 5012.123456, "NVRM: hello")
    assert rules.journal_record("1764627123.500000 node kernel: NVRM: hi") == (1764627123.5, "NVRM: hi")
    assert rules.timed("no stamp", booted) == (None, "no stamp")
    # A record without a time is judged whatever the watermark; one at or before it is not.
    records = [(None, xid(31)), (100.0, xid(79)), (200.0, xid(48))]
    assert [x.xid for x in rules.kernel_xids(records, "00000000:00:06.0", since=100.0)] == [31, 48]


def test_xids_before_the_driver_was_loaded_again_are_not_judged():
    loaded = "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build"
    records = [(100.0, xid(79)), (150.0, loaded), (200.0, xid(48))]
    assert [x.xid for x in rules.kernel_xids(records, "00000000:00:06.0")] == [48]


def test_the_watermark_moves_on_only_forward_and_keeps_the_counters(tmp_path):
    memory = watermark.Memory(tmp_path, "node/with:odd name", boot="b")
    assert memory.previous("GPU-1") == watermark.Previous()
    assert memory.keep("GPU-1", 100.0, {5: {"replay": 7, "CRC data": None}}) == ""
    assert memory.advance("GPU-1", 150.0) == "" and memory.advance("GPU-1", 120.0) == ""
    assert memory.previous("GPU-1") == watermark.Previous(looked_at=150.0, nvlink={5: {"replay": 7}})
    assert memory.keep("GPU-1", 160.0, {}, counters={"dcgm xid count": 2, "unread": None}) == ""
    assert memory.advance("GPU-1", 170.0) == "" and memory.previous("GPU-1").counters == {"dcgm xid count": 2.0}
    assert watermark.Memory(tmp_path, "node/with:odd name", boot="b2").previous("GPU-1").counters == {}
    (path := watermark.state_file(tmp_path, "node/with:odd name", "GPU-1")).write_text("{not json")
    assert path.parent.parent == tmp_path and memory.previous("GPU-1").problem


def only(findings):
    assert len(findings) == 1, [str(f) for f in findings]
    return findings[0]
