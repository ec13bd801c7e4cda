"""The health counters DCGM watches (stackproof/measure/counters.py reads, stackproof/judge/counters.py judges),
from the H200 recording replayed beneath stackproof (tests/nvml_replay), each turned red by altering one recorded
answer as a failing GPU would give it; and GPUs of other kinds stay green: a profile without ECC, row remapping,
retired pages, NVLink or a fabric (a GeForce / L-series card answers NotSupported), and a driver older than the
calls (FunctionNotFound). No torch, no GPU."""

# ruff: noqa: F811 (the replay fixture, imported from test_judge_health, is every test's argument)
from __future__ import annotations

import dataclasses
import json

import pytest
from test_judge_health import SYSFS, answer, checkup, only, recorded, replay  # noqa: F401

from stackproof.judge import counters as rules
from stackproof.measure import counters, topology

NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND = 3, 13
CORRECTED_VOLATILE, UNCORRECTED_AGGREGATE = [0, 0], [1, 1]
ENFORCED_60_PERCENT = 420_000  # mW: 60 % of the H200's 700 W default


def read(replay, recording=None, pci_root=SYSFS, seconds=0.0):
    replay(recording or recorded())
    with topology.nvml_session() as nvml:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        gpu = topology.read_gpu(nvml, 0, pci_root)
        reading = counters.read(nvml, handle, gpu, pci_root)
    reading.seconds = seconds
    return gpu, reading


def judged(replay, recording=None, **kwargs):
    gpu, reading = read(replay, recording, **kwargs)
    return rules.judge(gpu.index, gpu.uuid, reading)


def test_the_recorded_h200_reads_green_and_says_what_it_lacks(replay):
    gpu, reading = read(replay)
    assert rules.judge(gpu.index, gpu.uuid, reading) == [] and reading.errors == {}
    shown = rules.readings(reading)
    assert shown["pcie_replays"] == 0 and shown["pcie_replay_limit_per_min"] == pytest.approx(30.7)
    assert shown["retired_pages"] == "not supported" and shown["fabric_state"] == "not supported"
    assert shown["power_limit_w"] == "700 (default 700)" and shown["recovery_action"] == "none"
    assert shown["pcie_aer"] == "not supported"  # the VM's sysfs has no AER files


def test_the_replay_limit_is_per_lane():
    assert rules.replay_limit_per_minute(5, 16) == pytest.approx(30.7)  # 32 GT/s x 16 lanes x 1e-12 x 60
    assert rules.replay_limit_per_minute(3, 16) == 8  # DCGM's own 8 a minute, from a Gen3 x16 link
    assert rules.replay_limit_per_minute(4, 4) == 8 and rules.replay_limit_per_minute(None, None) == 8


@pytest.mark.parametrize(("climb", "red"), [(20, False), (5000, True)])
def test_pcie_replays_climbing_past_the_links_limit_are_a_finding(replay, climb, red):
    climbing = recorded()
    answer(climbing, "nvmlDeviceGetPcieReplayCounter", {"_sequence": [100, 100 + climb]})
    replay(climbing)
    with topology.nvml_session() as nvml:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        gpu = topology.read_gpu(nvml, 0, SYSFS)
        before = counters.read(nvml, handle, gpu, SYSFS)
        now = dataclasses.replace(counters.read(nvml, handle, gpu, SYSFS), seconds=before.seconds + 10)
    found = rules.judge(gpu.index, gpu.uuid, now, before)
    if not red:
        assert found == []  # 20 in a run shorter than a minute: under gen5 x16's 31 a minute
        return
    finding = only(found)
    assert (finding.check, finding.category, finding.severity) == ("PCIe replays", "interconnect", "triage")
    assert "5000 during the run" in finding.found and "30.7 a minute" in finding.expected


def test_hundreds_of_thousands_of_corrected_errors_are_a_finding(replay):
    many = recorded()
    answer(many, "nvmlDeviceGetTotalEccErrors", 312_000, CORRECTED_VOLATILE)
    finding = only(judged(replay, many))
    assert (finding.check, finding.category, finding.severity) == ("corrected ECC errors", "gpu-hardware", "triage")
    assert finding.found.startswith("312000 single-bit errors")


def test_corrected_errors_climbing_faster_than_dcgms_rate_are_a_finding():
    before, now = rules.CounterReading(sbe_volatile=10), rules.CounterReading(seconds=120.0, sbe_volatile=100)
    finding = only(rules.judge(0, "GPU-x", now, before))
    assert finding.check == "corrected ECC error rate" and "45 a minute" in finding.found
    assert rules.judge(0, "GPU-x", rules.CounterReading(seconds=30.0, sbe_volatile=15), before) == []


def test_an_uncorrected_error_in_the_gpus_life_is_triage(replay):
    once = recorded()
    answer(once, "nvmlDeviceGetTotalEccErrors", 2, UNCORRECTED_AGGREGATE)
    finding = only(judged(replay, once))
    assert (finding.check, finding.severity, finding.found) == ("uncorrected ECC errors in the GPU's life",
                                                                 "triage", "2")


def test_a_power_cap_is_a_configuration_finding_with_the_fix(replay):
    capped = recorded()
    answer(capped, "nvmlDeviceGetEnforcedPowerLimit", ENFORCED_60_PERCENT)
    finding = only(judged(replay, capped))
    assert (finding.check, finding.category) == ("power limit", "configuration")
    assert finding.found == "420 W enforced (60% of the default)" and "-pl 700" in finding.action


@pytest.mark.parametrize(("sbe", "dbe", "severity"), [(40, 23, "isolate"), (0, 16, "triage"), (30, 10, None)])
def test_retired_pages_follow_dcgms_limits(replay, sbe, dbe, severity):
    retired = recorded()
    answer(retired, "nvmlDeviceGetRetiredPages", list(range(sbe)), [0])
    answer(retired, "nvmlDeviceGetRetiredPages", list(range(dbe)), [1])
    found = judged(replay, retired)
    assert [f.severity for f in found] == ([severity] if severity else [])


def test_uncorrectable_remaps_past_the_spare_rows_are_triage(replay):
    remapped = recorded()
    answer(remapped, "nvmlDeviceGetRemappedRows", [0, 512, 0, 0])
    assert only(judged(replay, remapped)).check == "remapped rows"


@pytest.mark.parametrize(("fabric", "red"), [({"state": 1, "status": 0}, True), ({"state": 3, "status": 0}, False),
                                             ({"state": 3, "status": 999}, True), ({"state": 0, "status": 0}, False)])
def test_the_nvlink_fabric_must_have_completed_on_nvswitch_systems(replay, fabric, red):
    hgx = recorded()
    answer(hgx, "nvmlDeviceGetGpuFabricInfo", {"clusterUuid": "x", "cliqueId": 0, **fabric}, ["*"])
    found = judged(replay, hgx)
    assert [(f.check, f.category, f.severity) for f in found] == ([("NVLink fabric", "interconnect", "reset")]
                                                                   if red else [])


def test_the_drivers_recovery_action_is_a_finding(replay):
    asks = recorded()
    field = asks["devices"][0]["nvmlDeviceGetFieldValues"]["[[230]]"][0]
    field["value"]["uiVal"] = 2
    finding = only(judged(replay, asks))
    assert (finding.check, finding.found, finding.severity) == ("recovery action", "node reboot", "reset")


@pytest.mark.parametrize("call", ["nvmlDeviceGetEccMode", "nvmlDeviceGetMigMode"])
def test_a_pending_mode_is_a_configuration_finding(replay, call):
    pending = recorded()
    answer(pending, call, [1, 0])
    finding = only(judged(replay, pending))
    assert (finding.category, finding.severity) == ("configuration", "reset") and "pending 0" in finding.found


def test_application_clocks_below_default_are_a_configuration_finding(replay):
    low = recorded()
    answer(low, "nvmlDeviceGetApplicationsClock", 1200, [1])
    finding = only(judged(replay, low))
    assert finding.check == "application clocks (sm)" and finding.found == "1200 MHz"


def test_aer_counters_come_from_sysfs(replay, tmp_path):
    device = tmp_path / "0000:00:06.0"
    device.mkdir()
    for name in ("vendor", "device", "class", "max_link_width", "max_link_speed", "current_link_width",
                 "current_link_speed"):
        (device / name).write_text((SYSFS_DEVICE / name).read_text())
    (device / "aer_dev_correctable").write_text("RxErr 12\nBadTLP 3\nTOTAL_ERR_COR 15\n")
    (device / "aer_dev_nonfatal").write_text("Undefined 0\nTOTAL_ERR_NONFATAL 0\n")
    (device / "aer_dev_fatal").write_text("Undefined 0\nSurpriseDown 1\nTOTAL_ERR_FATAL 1\n")
    gpu, reading = read(replay, pci_root=str(tmp_path))
    assert reading.aer == {"correctable": 15, "nonfatal": 0, "fatal": 1}
    finding = only(rules.judge(gpu.index, gpu.uuid, reading))
    assert (finding.check, finding.category, finding.severity) == ("PCIe AER fatal errors", "interconnect", "reset")


SYSFS_DEVICE = __import__("pathlib").Path(SYSFS) / "0000:00:06.0"


def without_features(code: int) -> dict:
    """The H200 recording as a GPU without ECC, row remapping, retired pages, NVLink, fabric, recovery action or
    application clocks answers it (NotSupported), or as a driver older than those calls (FunctionNotFound)."""
    profile = recorded()
    table = profile["devices"][0]
    table["nvmlDeviceGetEccMode"] = {"[]": {"_error": code}}
    table["nvmlDeviceGetTotalEccErrors"] = {key: {"_error": code} for key in table["nvmlDeviceGetTotalEccErrors"]}
    for name in ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus",
                 "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetMigMode"):
        table[name] = {"[]": {"_error": code}}
    table["nvmlDeviceGetGpuFabricInfo"] = {'["*"]': {"_error": code}}
    for name in ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetApplicationsClock",
                 "nvmlDeviceGetDefaultApplicationsClock"):
        table[name] = {key: {"_error": code} for key in table[name]}
    field = table["nvmlDeviceGetFieldValues"]["[[230]]"][0]
    field["nvmlReturn"] = code
    return profile


@pytest.mark.parametrize("code", [NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND])
def test_a_gpu_without_these_features_stays_green(replay, code):
    gpu, reading = read(replay, without_features(code))
    assert rules.judge(gpu.index, gpu.uuid, reading) == [] and reading.errors == {}
    shown = rules.readings(reading)
    assert {shown[k] for k in ("pcie_replays", "ecc_sbe_volatile", "retired_pages", "fabric_state",
                               "recovery_action", "app_clocks", "mig_mode")} == {"not supported"}
    if code == NVML_ERROR_NOT_SUPPORTED:  # the health checkup over the same profile is green too
        _, result = checkup(replay, without_features(code))
        assert [f for f in result.findings if f.check != "ECC mode"] == []


def test_another_nvml_error_on_a_counter_is_kept_to_be_judged(replay):
    broken = recorded()
    answer(broken, "nvmlDeviceGetPcieReplayCounter", {"_error": 999})
    _, reading = read(replay, broken)
    assert reading.errors == {"PCIe replay counter": "NVML error Unknown Error"}


def test_the_fixture_profiles_are_written_from_the_recording():
    assert json.dumps(without_features(NVML_ERROR_NOT_SUPPORTED))  # serialisable, as the replay needs
