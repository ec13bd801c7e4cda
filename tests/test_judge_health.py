"""Health and capability judged from NVML readings recorded on an H200 (tests/fixtures/nvml/h200.json), replayed
by a fake pynvml put beneath stackproof (tests/nvml_replay/pynvml.py: the real nvidia-ml-py with the recorded
answers in place of the driver's). The unaltered recording is green; each finding is turned red by altering one
recorded reading, as a broken GPU would answer. No torch, no GPU."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from replay_support import install_replay

from stackproof.judge import bars, expectation, hardware, policy
from stackproof.judge import health as rules
from stackproof.measure import health, topology

FIXTURES = Path(__file__).parent / "fixtures"
RECORDING = json.loads((FIXTURES / "nvml" / "h200.json").read_text())
SYSFS = str(FIXTURES / "sysfs" / "h200-vm")
QUIET_LOG = str(FIXTURES / "kmsg" / "h200-healthy.log")
XID79_LOG = str(FIXTURES / "kmsg" / "h200-xid79.log")
GiB = 1 << 30
NVML_SUCCESS, NVML_ERROR_UNKNOWN, NVML_ERROR_TIMEOUT = 0, 999, 10
FIELD_NVLINK_SPEED_COMMON = 90
H200_NVLINKS, H200_NVLINK_MBPS = 18, 26562  # an H200 SXM's, as NVML reports them on an HGX board


def recorded() -> dict:
    return copy.deepcopy(RECORDING)


def answer(recording: dict, name: str, value, args: list | str = (), gpu: int | None = 0) -> None:
    """Alter one recorded reading: `name(args)` now answers `value` (on GPU `gpu`, or the system's when None)."""
    table = recording["system"] if gpu is None else recording["devices"][gpu]
    table.setdefault(name, {})[json.dumps(args if isinstance(args, str) else list(args))] = value


def with_nvlinks(recording: dict, down: tuple[int, ...] = (), links: int = H200_NVLINKS, gpu: int = 0) -> dict:
    """The recorded H200 as it answers on an HGX board: `links` NVLinks at 26562 MB/s, `down` of them down."""
    table = recording["devices"][gpu]
    table["nvmlDeviceGetNvLinkState"] = {json.dumps([link]): (0 if link in down else 1) if link < links else
                                         {"_error": 2} for link in range(36)}  # 2: InvalidArgument, no such link
    for link in range(links):
        for counter in range(4):
            answer(recording, "nvmlDeviceGetNvLinkErrorCounter", 0, [link, counter], gpu)
        # Each link is wired to an NVSwitch, up or down: NVML names its far end.
        answer(recording, "nvmlDeviceGetNvLinkRemotePciInfo", {"busId": f"00000000:{0xa0 + link % 4:02x}:00.0"},
               [link], gpu)
    field = table["nvmlDeviceGetFieldValues"][json.dumps([[FIELD_NVLINK_SPEED_COMMON]])][0]
    field.update(nvmlReturn=NVML_SUCCESS, valueType=1, value={**field["value"], "uiVal": H200_NVLINK_MBPS})
    return recording


@pytest.fixture
def replay(monkeypatch, tmp_path):
    """Install the fake pynvml answering from a (possibly altered) recording; returns the module."""
    return lambda recording: install_replay(monkeypatch, tmp_path, recording)


def inventory(replay, recording: dict | None = None) -> topology.Inventory:
    replay(recording or recorded())
    return topology.inventory(SYSFS)


def checkup(replay, recording: dict | None = None, kernel_log: str = QUIET_LOG, own_pids=frozenset()):
    replay(recording or recorded())
    with topology.nvml_session() as nvml:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        gpu = topology.read_gpu(nvml, 0, SYSFS)
        return gpu, health.examine(nvml, handle, gpu, set(own_pids), kernel_log)


def only(findings):
    assert len(findings) == 1, [str(f) for f in findings]
    return findings[0]


# --- The recorded H200 is green -------------------------------------------------------------------------------------

def test_the_recorded_h200_has_no_findings(replay):
    gpu, result = checkup(replay)
    assert result.findings == []
    assert (gpu.name, gpu.ecc_enabled, gpu.pcie_gen_gpu_max, gpu.pcie_width_gpu_max) == ("NVIDIA H200", True, 5, 16)
    assert (gpu.nvlink_supported, gpu.nvlink_active) == (0, 0)  # a VM's passthrough H200: PCIe only
    assert hardware.findings(gpu, [gpu]) == []
    assert result.readings["processes"] == "none" and result.readings["xids"] == "none"
    assert result.readings["kernel_log"] == QUIET_LOG and result.readings["memory_used_gib"] == 0.6
    found = topology.inventory(SYSFS)
    assert found.unreachable == {} and topology.missing_from_nvml(topology.nvidia_gpus_on_bus(SYSFS), found) == []


def test_the_recorded_h200_under_load_is_green(replay):
    """Recorded while a bf16 GEMM kept it busy: reasons 0x4 (SW power cap), its own process, gen5 x16."""
    loaded = recorded()
    for name, answers in RECORDING["under_load"][0].items():
        loaded["devices"][0][name] = answers
    gpu, result = checkup(replay, loaded, own_pids={RECORDING["pid"]})
    assert result.findings == []
    with topology.nvml_session() as nvml:
        handle, errors = nvml.nvmlDeviceGetHandleByIndex(0), {}
        reasons, samples = health.clock_reasons_while_busy(nvml, handle, errors, busy=lambda: False)
        assert (reasons, samples, errors) == (0x4, 1, {})
        now = health.pcie_link_under_load(nvml, handle, errors, bars.pcie_expected(gpu), pause_s=0)
        assert hardware.pcie_under_load(gpu, *now) is None
    assert rules.clock_findings(0, gpu.uuid, reasons, "under load") == []


def test_bars_come_from_what_the_recorded_h200_should_have(replay):
    gpu = inventory(replay).gpus[0]
    assert bars.pcie_bar(gpu, 0.7).value == pytest.approx(0.7 * 63.0e9, rel=1e-3)
    assert bars.hbm_bar(gpu, 0.7).value == pytest.approx(0.7 * 4.814e12, rel=1e-3)
    assert bars.busbw_bar([gpu], 1, 0.5, None).source == "0.5 x 63.0 GB/s peak (PCIe gen5 x16)"


# --- Each finding, from one altered reading ---------------------------------------------------------------------------

def test_ecc_turned_off_is_a_finding(replay):
    off = recorded()
    answer(off, "nvmlDeviceGetEccMode", [0, 0])
    finding = only(checkup(replay, off)[1].findings)
    assert (finding.check, finding.found, finding.category, finding.severity) == (
        "ECC mode", "disabled (memory errors go undetected)", "configuration", "reset")
    assert str(finding).startswith("GPU 0 GPU-c4196b9c-c4c5-db22-ca92-77543dd34a0b: ECC mode")


def test_a_gen3_x8_link_is_judged_against_the_gpus_own_gen5_x16(replay):
    slow = recorded()
    for name, value in (("nvmlDeviceGetMaxPcieLinkGeneration", 3), ("nvmlDeviceGetMaxPcieLinkWidth", 8),
                        ("nvmlDeviceGetCurrPcieLinkGeneration", 3), ("nvmlDeviceGetCurrPcieLinkWidth", 8)):
        answer(slow, name, value)
    gpu = inventory(replay, slow).gpus[0]
    assert {f.check for f in hardware.findings(gpu, [gpu])} == {"PCIe generation allowed", "PCIe link width"}
    # The bar stays the GPU's own gen5 x16 (0.7 x 63 GB/s), not the degraded link's 0.7 x 7.9 GB/s.
    assert bars.pcie_bar(gpu, 0.7).value == pytest.approx(0.7 * 63.0e9, rel=1e-3)
    with topology.nvml_session() as nvml:
        now = health.pcie_link_under_load(nvml, nvml.nvmlDeviceGetHandleByIndex(0), {}, bars.pcie_expected(gpu),
                                          pause_s=0)
    finding = hardware.pcie_under_load(gpu, *now)
    assert (finding.expected, finding.found) == ("gen5 x16 (the GPU's own max)", "gen3 x8 while copying (downtrained)")


def test_an_nvlink_down_is_a_finding_and_keeps_the_bar(replay):
    healthy = inventory(replay, with_nvlinks(recorded())).gpus[0]
    assert (healthy.nvlink_supported, healthy.nvlink_active, hardware.findings(healthy, [healthy])) == (18, 18, [])
    gpu = inventory(replay, with_nvlinks(recorded(), down=(3,))).gpus[0]
    finding = only(hardware.findings(gpu, [gpu]))
    assert (finding.check, finding.found, finding.category) == ("NVLink down", "link(s) 3 down (17 up)",
                                                                "interconnect")
    # The bar is the 18 links the GPU has, not the 17 up now.
    assert bars.busbw_bar([gpu], 1, 0.5, None).value == bars.busbw_bar([healthy], 1, 0.5, None).value == pytest.approx(
        0.5 * 18 * 26.562, abs=0.1)


def test_fewer_nvlinks_than_the_nodes_other_gpus_is_a_finding(replay):
    node = with_nvlinks(recorded())
    second = copy.deepcopy(node["devices"][0])
    second["nvmlDeviceGetUUID"] = {"[]": "GPU-c4196b9c-c4c5-db22-ca92-000000000002"}
    node["devices"].append(second)
    node["system"]["nvmlDeviceGetCount"] = {"[]": 2}
    node["system"]["nvmlDeviceGetHandleByIndex"]["[1]"] = {"_handle": 1}
    with_nvlinks(node, links=12, gpu=1)  # the GPU shows 12 of its links at all
    gpus = inventory(replay, node).gpus
    assert hardware.findings(gpus[0], gpus) == []
    finding = only(hardware.findings(gpus[1], gpus))
    assert (finding.check, finding.expected, finding.found) == (
        "NVLinks present", "18 NVLinks, as the node's other NVIDIA H200 GPUs have", "12")
    assert bars.busbw_bar(gpus, 1, 0.5, None).value == pytest.approx(0.5 * 18 * 26.562, abs=0.1)


def test_xid_79_in_the_kernel_log_is_a_finding_with_its_meaning(replay):
    finding = only(checkup(replay, kernel_log=XID79_LOG)[1].findings)
    assert (finding.check, finding.category, finding.severity) == ("XID 79", "gpu-hardware", "isolate")
    assert finding.found.startswith("XID 79: GPU has fallen off the bus")
    # Another GPU's XID is not this one's.
    assert rules.kernel_xids(Path(XID79_LOG).read_text().splitlines(), "00000000:18:00.0") == []


def test_xid_events_from_nvml_during_the_run(replay):
    events = recorded()
    event = {"device": {"_handle": 0}, "eventType": 8, "eventData": 95, "gpuInstanceId": 0, "computeInstanceId": 0}
    answer(events, "nvmlEventSetWait_v2", {"_sequence": [event, {"_error": NVML_ERROR_TIMEOUT}]}, "*", gpu=None)
    replay(events)
    with topology.nvml_session() as nvml:
        watch = health.XidWatch(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
        found = watch.events()
    assert found == [rules.Xid(95, "NVML event")] and watch.errors == {}
    finding = only(rules.xid_findings(0, "GPU-x", found))
    assert (finding.found, finding.severity) == ("XID 95: uncontained ECC error", "reset")
    replay(recorded())  # the recorded healthy GPU: the wait times out, no event
    with topology.nvml_session() as nvml:
        assert health.XidWatch(nvml, nvml.nvmlDeviceGetHandleByIndex(0)).events() == []


def test_application_xids_are_readings_not_findings():
    assert rules.xid_findings(0, "GPU-x", [rules.Xid(13, "kernel log"), rules.Xid(31, "NVML event")]) == []
    unknown = only(rules.xid_findings(0, "GPU-x", [rules.Xid(999, "kernel log")]))
    assert unknown.severity == "triage" and "Xid catalog" in unknown.action


def test_a_foreign_process_holding_100_gib_is_named(replay):
    held = recorded()
    loaded = RECORDING["under_load"][0]  # the recording's own process, with its context, and the memory then
    ours = loaded["nvmlDeviceGetComputeRunningProcesses"]["[]"]
    zombie = {"pid": 4242, "usedGpuMemory": 100 * GiB, "gpuInstanceId": 4294967295, "computeInstanceId": 4294967295}
    answer(held, "nvmlDeviceGetComputeRunningProcesses", [*ours, zombie])
    memory = loaded["nvmlDeviceGetMemoryInfo"]["[]"]
    answer(held, "nvmlDeviceGetMemoryInfo", {**memory, "used": memory["used"] + 100 * GiB})
    answer(held, "nvmlSystemGetProcessName", "python3", [4242], gpu=None)
    answer(held, "nvmlSystemGetProcessName", "python3", [RECORDING["pid"]], gpu=None)
    found = {f.check: f for f in checkup(replay, held, own_pids={RECORDING["pid"]})[1].findings}
    assert set(found) == {"other processes on the GPU", "memory in use before the run"}
    assert found["other processes on the GPU"].found == "pid 4242 (python3) holding 100.0 GiB"
    assert found["memory in use before the run"].found == "100.6 GiB in use beyond this run's processes"
    # The DaemonSet or a HealthCheckProgram: no job was given the GPU yet, an alert.
    assert {policy.of(f) for f in found.values()} == {policy.ALERT}
    # A Prolog: job 777 was given this GPU; the leftover keeps the job off the node (a drain, naming the pid).
    replay(held)
    with topology.nvml_session() as nvml:
        gpu = topology.read_gpu(nvml, 0, SYSFS)
        prolog = health.examine(nvml, nvml.nvmlDeviceGetHandleByIndex(0), gpu, {RECORDING["pid"]}, QUIET_LOG,
                                job="777").findings
    held_by = {f.check: f for f in prolog}["other processes on the GPU"]
    assert (held_by.category, held_by.severity, policy.of(held_by)) == ("gpu-hardware", "reset", policy.DRAIN)
    assert "job 777" in held_by.action and "kill 4242" in held_by.action and "nvidia-smi -r -i 0" in held_by.action


def test_this_runs_own_rank_is_not_another_process(replay):
    loaded = recorded()
    loaded["devices"][0].update(RECORDING["under_load"][0])
    assert checkup(replay, loaded, own_pids={RECORDING["pid"]})[1].findings == []
    # In a container's PID namespace NVML's pids are the host's: the rank's own small context is still not "other".
    reading = rules.HealthReading(processes=[rules.Process(90001, "n/a", 900 << 20)], memory_used_bytes=1500 << 20,
                                  memory_total_bytes=150754820096)
    assert rules.foreign_processes(reading, {17}, own_count=1) == []
    zombie = rules.Process(90002, "n/a", 100 * GiB)
    reading.processes.append(zombie)
    assert rules.foreign_processes(reading, {17}, own_count=1) == [zombie]


def test_thermal_slowdown_under_load_is_a_finding(replay):
    hot = recorded()
    answer(hot, "nvmlDeviceGetCurrentClocksEventReasons", 0x60)
    replay(hot)
    with topology.nvml_session() as nvml:
        reasons, _ = health.clock_reasons_while_busy(nvml, nvml.nvmlDeviceGetHandleByIndex(0), {}, busy=lambda: False)
    found = rules.clock_findings(0, "GPU-x", reasons, "under load")
    assert [f.found for f in found] == ["HW thermal slowdown active (reasons 0x60)",
                                        "SW thermal slowdown active (reasons 0x60)"]
    assert all(f.check == "clock-event reasons under load" and f.category == "gpu-hardware" for f in found)


def test_clock_reason_bits_are_nvmls():
    import pynvml

    ours = (rules.HW_SLOWDOWN, rules.SW_THERMAL, rules.HW_THERMAL, rules.HW_POWER_BRAKE)
    assert ours == (pynvml.nvmlClocksEventReasonHwSlowdown, pynvml.nvmlClocksEventReasonSwThermalSlowdown,
                    pynvml.nvmlClocksEventReasonHwThermalSlowdown, pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown)


@pytest.mark.parametrize("code", [NVML_ERROR_UNKNOWN, 15])  # Unknown Error; GPU is lost
def test_a_gpu_nvml_cannot_reach_is_a_finding_never_a_traceback(replay, code):
    lost = recorded()
    answer(lost, "nvmlDeviceGetHandleByIndex", {"_error": code}, [0], gpu=None)
    found = inventory(replay, lost)
    assert found.gpus == [] and list(found.unreachable) == [0]
    finding = hardware.unreachable(0, found.unreachable[0])
    assert (finding.category, finding.severity) == ("gpu-hardware", "isolate")


# --- GPUs expected from the PCI bus -------------------------------------------------------------------------------

def bus_with_two_gpus(tmp_path) -> str:
    root = tmp_path / "sysfs"
    shutil.copytree(SYSFS, root)
    shutil.copytree(root / "0000:00:06.0", root / "0000:00:07.0")
    return str(root)


def test_the_bus_says_how_many_gpus_are_expected(tmp_path):
    assert topology.nvidia_gpus_on_bus(SYSFS) == ["0000:00:06.0"]  # the VM's virtio and bridge functions are not
    assert topology.nvidia_gpus_on_bus(str(tmp_path / "absent")) is None
    two = topology.nvidia_gpus_on_bus(bus_with_two_gpus(tmp_path))
    assert expectation.expected_gpus(None, {}, two).count == 2
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "all"}, two).count == 2
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, two).count == 1
    assert expectation.expected_gpus(None, {"SLURM_GPUS_ON_NODE": "1"}, two).count == 1
    assert expectation.expected_gpus(None, {"CUDA_VISIBLE_DEVICES": "0"}, two).count == 1
    assert expectation.expected_gpus(0, {}, two).count == 0
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "void"}, two).count == 0
    assert expectation.expected_gpus(None, {}, None).count == 0  # no bus visible: today's rule
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "all"}, None).count == 1
    # A list of devices expects every one of them (issue 25): a Prolog's job given 8 GPUs on a node that lost 7.
    eight = ",".join(map(str, range(8)))
    assert expectation.expected_gpus(None, {"CUDA_VISIBLE_DEVICES": eight}, two) == expectation.Expected(
        8, expectation.DEVICE_LIST, f"CUDA_VISIBLE_DEVICES={eight}")
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"}, None).count == 3
    assert expectation.expected_gpus(None, {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c",
                                            "CUDA_VISIBLE_DEVICES": "0,1"}, None).count == 2  # CUDA's choice within
    assert expectation.expected_gpus(None, {"CUDA_VISIBLE_DEVICES": "0,-1,2"}, two).count == 1  # CUDA stops at -1
    assert expectation.expected_gpus(None, {"CUDA_VISIBLE_DEVICES": "-1"}, two).count == 0


def test_a_gpu_on_the_bus_but_not_to_nvml_is_named(replay, tmp_path):
    found = inventory(replay)
    bus = topology.nvidia_gpus_on_bus(bus_with_two_gpus(tmp_path))
    assert topology.missing_from_nvml(bus, found) == ["0000:00:07.0"]
    assert topology.missing_from_nvml(["0000:00:06.0"], None) == ["0000:00:06.0"]  # NVML cannot answer at all


def test_lost_gpus_are_the_nodes_only_when_the_scheduler_or_the_bus_expected_them():
    """Decided on the evidence's kind, never on the words that explain it."""
    slurm = expectation.expected_gpus(None, {"SLURM_GPUS_ON_NODE": "8"}, ["0000:00:06.0"])
    assert expectation.lost_by_the_node(slurm, 1, 1)  # the job was given 8 GPUs: 7 lost, wherever the bus says
    flag = expectation.expected_gpus(4, {}, ["0000:00:06.0", "0000:00:07.0"])
    assert not expectation.lost_by_the_node(flag, 2, 2)  # the flag asked for more than the node has
    bus = expectation.expected_gpus(None, {}, ["0000:00:06.0", "0000:00:07.0"])
    assert bus.source == expectation.BUS and expectation.lost_by_the_node(bus, 1, 2)
