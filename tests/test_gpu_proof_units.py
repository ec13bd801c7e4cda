"""Unit tests of the per-GPU proof tier: the peaks and bars of judge/bars.py (H200 as the known answer), the
digest chain, the cross-rank decisions, and every NVML failure path of topology.py and health.py.

NVML cannot run without an NVIDIA driver, so each NVML test hands in `FakeNvml`: the real nvidia-ml-py module's
constants and exception classes, with one GPU's answers in place of the driver's."""

import os
from pathlib import Path

import pynvml
import pytest
import torch

from stackproof.judge import bars, hardware, per_gpu
from stackproof.measure import gpu_proof, health, topology, watermark

NO_SYSFS = "/nonexistent/sysfs"  # the GPU's own PCIe width then falls back to NVML's
QUIET_KERNEL_LOG = str(Path(__file__).parent / "fixtures" / "kmsg" / "h200-healthy.log")


class Fails:
    """An answer that raises the real pynvml exception for an NVML return code."""

    def __init__(self, code: int):
        self.code = code


class FakeNvml:
    """pynvml with one GPU: `answers` maps an nvmlDevice* function to its value, to a function of the call's
    arguments after the handle, or to Fails(code). Functions not answered say NotSupported, as NVML does for
    features a GPU lacks."""

    def __init__(self, **answers):
        self.answers = answers

    def __getattr__(self, name):
        if not name.startswith("nvmlDevice"):
            return getattr(pynvml, name)  # constants and exception classes: the real ones
        answer = self.answers.get(name, Fails(pynvml.NVML_ERROR_NOT_SUPPORTED))

        def call(handle=None, *args):
            value = answer(*args) if callable(answer) else answer
            if isinstance(value, Fails):
                raise pynvml.NVMLError(value.code)
            return value

        return call


class PciInfo:
    busId = b"00000000:18:00.0"


class Memory:
    total = 141 * (1 << 30)
    used = 645 << 20


H200_ANSWERS = {  # what NVML answered on an H200 (retired pages: NotSupported, the GPU remaps rows instead)
    "nvmlDeviceGetHandleByIndex": "handle", "nvmlDeviceGetHandleByUUID": "handle",
    "nvmlDeviceGetName": "NVIDIA H200", "nvmlDeviceGetUUID": "GPU-8c1d7f3a-0000-4000-8000-000000000001",
    "nvmlDeviceGetMemoryInfo": Memory(), "nvmlDeviceGetSerial": "1654123456789", "nvmlDeviceGetPciInfo": PciInfo(),
    "nvmlDeviceGetNvLinkState": lambda link: pynvml.NVML_FEATURE_ENABLED if link < 18 else Fails(
        pynvml.NVML_ERROR_INVALID_ARGUMENT),
    "nvmlDeviceGetMaxPcieLinkGeneration": 5, "nvmlDeviceGetMaxPcieLinkWidth": 16,
    "nvmlDeviceGetCurrPcieLinkGeneration": 1, "nvmlDeviceGetCurrPcieLinkWidth": 16,
    "nvmlDeviceGetMemoryBusWidth": 6016,
    "nvmlDeviceGetMaxClockInfo": lambda clock: {pynvml.NVML_CLOCK_MEM: 3201, pynvml.NVML_CLOCK_SM: 1980}[clock],
    "nvmlDeviceGetTotalEccErrors": lambda kind, counter: 0,
    "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
    "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonGpuIdle,
    "nvmlDeviceGetNvLinkErrorCounter": lambda link, counter: 0,
    "nvmlDeviceGetTemperature": lambda sensor: 31,
    "nvmlDeviceGetTemperatureThreshold": lambda kind: {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 87}.get(
        kind, Fails(pynvml.NVML_ERROR_NOT_SUPPORTED)),
}


def h200_nvml(**changes) -> FakeNvml:
    return FakeNvml(**{**H200_ANSWERS, **changes})


def test_inventory_reads_identity_and_the_values_the_bars_derive_from():
    gpu = topology.read_gpu(h200_nvml(), 0, NO_SYSFS)
    assert (gpu.name, gpu.serial, gpu.pci_bus_id) == ("NVIDIA H200", "1654123456789", "00000000:18:00.0")
    assert (gpu.memory_bus_width_bits, gpu.max_memory_clock_mhz, gpu.max_sm_clock_mhz) == (6016, 3201, 1980)
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.pcie_gen_current, gpu.pcie_width_current) == (5, 16, 1, 16)
    assert (gpu.nvlink_active, gpu.nvlink_supported, gpu.nvlinks_down) == (18, 18, [])
    # NotSupported is "not applicable": no value, and no finding.
    assert gpu.nvlink_speed_mbps == 0
    assert gpu.nvml_errors == {}
    assert bars.pcie_peak_gbps(*bars.pcie_expected(gpu)) == pytest.approx(63.0, abs=0.05)


def test_inventory_reports_an_nvml_error_instead_of_swallowing_it():
    nvml = h200_nvml(nvmlDeviceGetMemoryBusWidth=Fails(pynvml.NVML_ERROR_NO_PERMISSION),
                     nvmlDeviceGetSerial=Fails(pynvml.NVML_ERROR_GPU_IS_LOST))
    gpu = topology.read_gpu(nvml, 0, NO_SYSFS)
    assert gpu.memory_bus_width_bits is None and gpu.serial is None
    assert gpu.nvml_errors == {"memory bus width": "NVML error Insufficient Permissions",
                               "serial": "NVML error GPU is lost"}


def test_nvlink_numbers_past_the_gpus_count_are_not_findings_but_a_failing_link_query_is():
    errors = {}
    assert topology.nvlinks_up(h200_nvml(), "h", errors) == list(range(18)) and errors == {}
    lost = h200_nvml(nvmlDeviceGetNvLinkState=lambda link: Fails(pynvml.NVML_ERROR_GPU_IS_LOST) if link == 3 else 1)
    assert 3 not in topology.nvlinks_up(lost, "h", errors)
    assert errors == {"NVLink 3 state": "NVML error GPU is lost"}


def test_a_field_value_that_fails_is_a_finding_and_not_supported_is_not():
    class Value:
        def __init__(self, ret):
            self.nvmlReturn, self.valueType, self.value = ret, 1, None

    errors = {}
    absent = h200_nvml(nvmlDeviceGetFieldValues=[Value(pynvml.NVML_ERROR_NOT_SUPPORTED)])
    assert topology._field(absent, "h", errors, 1) is None and errors == {}
    bad = topology._field(h200_nvml(nvmlDeviceGetFieldValues=[Value(pynvml.NVML_ERROR_TIMEOUT)]), "h", errors, 1)
    assert bad is None and errors == {"field 1": "NVML error Timeout"}


def test_a_bug_in_the_caller_is_not_taken_for_a_missing_feature():
    def broken(*args):
        raise TypeError("wrong arguments")

    with pytest.raises(TypeError):
        topology.read_gpu(h200_nvml(nvmlDeviceGetMemoryBusWidth=broken), 0, NO_SYSFS)


def test_gpu_found_by_uuid_with_or_without_nvml_prefix():
    inventory = topology.Inventory("580.1", "13.0", [topology.read_gpu(h200_nvml(), 0, NO_SYSFS)])
    assert topology.by_uuid(inventory, "8c1d7f3a-0000-4000-8000-000000000001").index == 0
    assert topology.by_uuid(inventory, "GPU-8c1d7f3a-0000-4000-8000-000000000001").index == 0
    assert topology.by_uuid(inventory, "GPU-ffffffff") is None


def test_a_pair_is_held_to_the_links_its_gpus_have_not_the_ones_up_now():
    """Two H200s through an NVSwitch (no direct link): link 3 of the first is down, its bar is still 18 links."""
    class SwitchPort:
        busId = b"00000000:a0:00.0"

    down = h200_nvml(nvmlDeviceGetNvLinkState=lambda link: (0 if link == 3 else 1) if link < 18 else Fails(
        pynvml.NVML_ERROR_INVALID_ARGUMENT), nvmlDeviceGetP2PStatus=lambda other, caps: pynvml.NVML_P2P_STATUS_OK,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda link: SwitchPort())
    a, b = topology.read_gpu(down, 0, NO_SYSFS), topology.read_gpu(h200_nvml(), 0, NO_SYSFS)
    a.nvlink_speed_mbps = b.nvlink_speed_mbps = 26562
    assert (a.nvlink_active, a.nvlink_supported, a.nvlinks_down) == (17, 18, [3])
    link = bars.pair_link(topology.pair_reading(down, a, b))
    assert (link.kind, link.label) == ("NVLink", "NVLink 18 links x 26562 MB/s")
    assert link.gbps == pytest.approx(18 * 26.562, rel=1e-3)


# --- Bars derived from NVML values: H200 as the known answer -----------------------------------------------------

def test_hbm_peak_from_bus_width_and_memory_clock():
    assert bars.hbm_peak_bytes_per_s(6016, 3201) == pytest.approx(4.814e12, rel=1e-3)
    # The 4.25 TB/s an H200 copy reaches is 0.88 of it: the 0.7 bar passes it and fails a GPU at 3.3 TB/s.
    bar = bars.hbm_bar(topology.read_gpu(h200_nvml(), 0, NO_SYSFS), 0.7)
    assert bar.value == pytest.approx(3.37e12, rel=1e-3) and "6016 bit x 3201 MHz x 2" in bar.source
    assert 3.3e12 < bar.value < 4.25e12


def test_pcie_peak_from_generation_and_width():
    assert bars.pcie_peak_gbps(5, 16) == pytest.approx(63.0, rel=1e-3)
    assert bars.pcie_peak_gbps(4, 16) == pytest.approx(31.5, rel=1e-3)
    bar = bars.pcie_bar(topology.read_gpu(h200_nvml(), 0, NO_SYSFS), 0.7)
    assert bar.value < 55e9 and "PCIe gen5 x16" in bar.source  # the 55 GB/s measured each way passes


def test_gemm_peak_from_sm_count_clock_and_architecture():
    assert bars.gemm_peak_flops(132, 1980, (9, 0)) == pytest.approx(1070.5e12, rel=1e-3)  # H200
    assert bars.gemm_peak_flops(132, 1830, (9, 0)) == pytest.approx(989.4e12, rel=1e-3)  # H100 datasheet
    assert bars.gemm_peak_flops(108, 1410, (8, 0)) == pytest.approx(312e12, rel=1e-3)  # A100 datasheet
    bar = bars.gemm_bar(132, 1980, (9, 0), 0.6)
    assert 600e12 < bar.value < 789e12 and "132 SMs x 1980 MHz x 4096" in bar.source


def test_no_bar_is_derived_from_missing_values_and_the_reason_says_so():
    bare = topology.Gpu(0, "GPU", "GPU-0", 0)
    assert bars.hbm_bar(bare, 0.7).value is None and "memory bus width" in bars.hbm_bar(bare, 0.7).source
    assert bars.pcie_bar(bare, 0.7).value is None
    assert bars.gemm_bar(132, None, (9, 0), 0.6).value is None
    unknown = bars.gemm_bar(148, 1965, (12, 1), 0.6)
    assert unknown.value is None and "sm_121" in unknown.source



# --- Silent data corruption: the digest chain and the exact GEMM, on the CPU ---------------------------------------

def test_digest_chain_is_deterministic_and_one_ulp_changes_it():
    cpu = torch.device("cpu")
    first = gpu_proof.digest_chain(cpu, n=128, steps=4)
    assert gpu_proof.digest_chain(cpu, n=128, steps=4) == first
    assert gpu_proof.digest_chain(cpu, n=128, steps=4, perturb=True) != first
    assert gpu_proof.digest_chain(cpu, n=128, steps=4, seed=7) != first


def test_one_ulp_moves_one_element_by_its_last_bit():
    for dtype, ulp in ((torch.bfloat16, 2**-7), (torch.float32, 2**-23)):
        ones = torch.ones(2, 2, dtype=dtype)
        bumped = gpu_proof.one_ulp_up(ones)
        assert bumped[0, 0].item() == 1 + ulp and torch.equal(bumped.flatten()[1:], ones.flatten()[1:])
        assert torch.equal(ones, torch.ones(2, 2, dtype=dtype))  # the input is left alone


def test_exact_gemm_is_exact_on_a_good_device_and_catches_one_ulp():
    cpu = torch.device("cpu")
    assert gpu_proof.exact_gemm_mismatches(cpu, m=256) == {"bfloat16": 0, "float32": 0}
    # bf16 shows the one ulp (1 + 2**-7) in the outputs of magnitude below 2; in fp32 the ulp (2**-23) vanishes
    # into partial sums above 2, which is why the fp32 chain of the digest is there.
    assert gpu_proof.exact_gemm_mismatches(cpu, m=256, perturb=True)["bfloat16"] > 0


# --- Cross-rank decisions ----------------------------------------------------------------------------------------

def test_odd_ones_out_names_the_minority_and_everyone_on_a_tie():
    assert per_gpu.odd_ones_out(["a", "a", "b", "a"]) == [2]
    assert per_gpu.odd_ones_out(["a", "a"]) == []
    assert per_gpu.odd_ones_out(["a"]) == [] and per_gpu.odd_ones_out([]) == []
    assert per_gpu.odd_ones_out(["a", "b"]) == [0, 1]  # two GPUs that disagree: no majority
    assert per_gpu.odd_ones_out(["a", "b"], trusted=[True, False]) == [1]  # the exact GEMM breaks the tie
    assert per_gpu.odd_ones_out(["a", "b"], trusted=[False, False]) == [0, 1]


def test_below_median_names_the_slow_ones():
    assert per_gpu.below_median([790.0, 795.0, 600.0, 799.0], 0.10) == [2]
    assert per_gpu.below_median([790.0, 720.0, 799.0], 0.10) == []  # 720 is 8.9% below the median 790
    assert per_gpu.below_median([790.0, 395.0], 0.10) == [1]  # two GPUs: the median is their mean
    assert per_gpu.below_median([], 0.10) == []


def test_digests_compare_only_within_a_model_and_say_what_was_expected():
    entries = [{"model": "H200 (132 SMs)", "digest": "d1", "exact": True},
               {"model": "H200 (132 SMs)", "digest": "d2", "exact": False},
               {"model": "H100 (132 SMs)", "digest": "e1", "exact": True},
               {"model": "H100 (132 SMs)", "digest": "e1", "exact": True}]
    verdict = per_gpu.odd_ones_out_by_model(entries)
    assert verdict["odd"] == [{"rank": 1, "found": "d2", "expected": "d1", "severity": "isolate"}]
    assert verdict["reference"] == {"H200 (132 SMs)": "d1", "H100 (132 SMs)": "e1"}


def test_a_two_gpu_digest_tie_isolates_neither_gpu_and_still_drains_the_node():
    """1 against 1 (issue 33): one of the two computes wrong and nothing tells which; before, both GPUs were
    failed as isolate (a GPU to take out) for one GPU's fault."""
    from stackproof.judge import policy
    from stackproof.judge.findings import Finding

    tie = per_gpu.odd_ones_out_by_model([{"model": "H200", "digest": d, "exact": True} for d in ("d1", "d2")])
    assert [(o["rank"], o["expected"], o["severity"]) for o in tie["odd"]] == [(0, None, "triage"), (1, None, "triage")]
    finding = Finding(0, "GPU-0", "per_gpu::sdc_digest", "x", "y", "gpu-hardware", tie["odd"][0]["severity"], "z")
    assert policy.of(finding) == policy.DRAIN  # the node still comes out: one of its GPUs computes wrong


def test_gemm_median_is_per_model():
    entries = [{"model": model, "value": value} for model, value in (
        ("H200", 790e12), ("H200", 400e12), ("A100", 280e12), ("A100", 281e12), ("A100", 279e12))]
    verdict = per_gpu.below_median_by_model(entries, 0.10)
    assert [s["rank"] for s in verdict["slow"]] == [1]
    assert verdict["median"]["A100"] == 280e12 and verdict["slow"][0]["median"] == 595e12
    failed = per_gpu.below_median_by_model([{"model": "H200", "value": None}, *entries[:2]], 0.10)
    assert [s["rank"] for s in failed["slow"]] == [2]  # a rank whose measurement failed neither votes nor counts


# --- Health history: every NVML path -----------------------------------------------------------------------------

def checkup(memory=None, **changes):
    nvml = h200_nvml(**changes)
    return health.examine(nvml, "handle", topology.read_gpu(nvml, 0, NO_SYSFS), set(), QUIET_KERNEL_LOG,
                          memory=memory)


def since_a_healthy_look(tmp_path, **changes):
    """The checkup after a first look at the healthy H200 (its counters at 0) kept in a state folder."""
    memory = watermark.Memory(tmp_path / "state", "node-a", boot="boot-1")
    assert checkup(memory).findings == []
    return checkup(memory, **changes)


def only(findings):
    assert len(findings) == 1, [str(f) for f in findings]
    return findings[0]


def test_a_healthy_h200_has_no_findings_even_at_idle_pcie_gen1():
    result = checkup()
    assert result.findings == []
    assert result.readings["retired_pages_pending"] == "n/a"  # NotSupported: H200 remaps rows instead
    assert result.readings["pcie"] == "gen1 x16 (max gen5 x16)"
    assert result.readings["nvlink_errors"] == "CRC flit=0, CRC data=0, replay=0, recovery=0"
    assert (result.readings["temperature_c"], result.readings["slowdown_c"]) == (31, 87)


@pytest.mark.parametrize(("changes", "check", "category", "severity"), [
    ({"nvmlDeviceGetRemappedRows": (0, 1, 1, 0)}, "row remapping", "gpu-hardware", "reset"),
    ({"nvmlDeviceGetRemappedRows": (0, 9, 0, 1)}, "row remapping", "gpu-hardware", "isolate"),
    ({"nvmlDeviceGetRetiredPagesPendingStatus": 1}, "page retirement", "gpu-hardware", "reset"),
    ({"nvmlDeviceGetTotalEccErrors": lambda kind, counter: 3}, "uncorrected ECC", "gpu-hardware", "reset"),
    ({"nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown},
     "clock-event reasons at rest", "gpu-hardware", "triage"),
    ({"nvmlDeviceGetNvLinkErrorCounter": lambda link, counter: 5 if (link, counter) == (
        7, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY) else 0}, "NVLink recovery errors", "interconnect", "triage"),
    ({"nvmlDeviceGetTemperature": lambda sensor: 88}, "temperature", "gpu-hardware", "triage"),
])
def test_each_health_record_becomes_a_finding_naming_the_gpu(changes, check, category, severity, tmp_path):
    finding = only(since_a_healthy_look(tmp_path, **changes).findings)
    assert (finding.check, finding.category, finding.severity) == (check, category, severity)
    text = str(finding)
    assert text.startswith("GPU 0 GPU-8c1d7f3a-0000-4000-8000-000000000001: ") and "expected" in text
    assert "fix: " in text and finding.action


def test_chosen_clock_limits_are_not_trouble():
    reasons = (pynvml.nvmlClocksEventReasonGpuIdle | pynvml.nvmlClocksEventReasonApplicationsClocksSetting
               | pynvml.nvmlClocksEventReasonSwPowerCap)
    assert checkup(nvmlDeviceGetCurrentClocksEventReasons=reasons).findings == []


def test_nvlink_replays_fail_naming_the_links_and_crc_counts_are_reported(tmp_path):
    result = since_a_healthy_look(tmp_path, nvmlDeviceGetNvLinkErrorCounter=lambda link, counter: 2 if link in (
        3, 4) and counter == pynvml.NVML_NVLINK_ERROR_DL_REPLAY else 0)
    assert only(result.findings).found == "link 3: +2, link 4: +2"
    # As seen on a healthy H200: CRC data errors the link corrected itself, no replay or recovery.
    crc = checkup(nvmlDeviceGetNvLinkErrorCounter=lambda link, counter: 510 if link == 2 and counter == (
        pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA) else 0)
    assert crc.findings == [] and "CRC data=510" in crc.readings["nvlink_errors"]


@pytest.mark.parametrize(("code", "category", "severity"), [
    (pynvml.NVML_ERROR_GPU_IS_LOST, "gpu-hardware", "isolate"),
    (pynvml.NVML_ERROR_CORRUPTED_INFOROM, "gpu-hardware", "isolate"),
    (pynvml.NVML_ERROR_RESET_REQUIRED, "gpu-hardware", "reset"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "configuration", "triage"),
    (pynvml.NVML_ERROR_UNKNOWN, "configuration", "triage"),
])
def test_an_nvml_error_is_a_finding_never_a_pass(code, category, severity):
    finding = only(checkup(nvmlDeviceGetTotalEccErrors=Fails(code)).findings)
    assert finding.check == "volatile uncorrected ECC" and finding.found == f"n/a: NVML error {pynvml.NVMLError(code)}"
    assert (finding.category, finding.severity) == (category, severity)


def test_nvml_errors_of_the_inventory_are_findings_too():
    finding = only(checkup(nvmlDeviceGetMaxClockInfo=Fails(pynvml.NVML_ERROR_TIMEOUT)).findings[:1])
    assert finding.check == "max memory clock" and finding.found == "n/a: NVML error Timeout"


def test_not_supported_everywhere_is_no_finding():
    """A GPU without ECC, row remapping, NVLink or thermal thresholds (a consumer part) has nothing to report."""
    nvml = FakeNvml(**{name: H200_ANSWERS[name] for name in (
        "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo")})
    result = health.examine(nvml, "handle", topology.read_gpu(nvml, 0, NO_SYSFS), set(), QUIET_KERNEL_LOG)
    assert result.findings == [] and result.readings["nvlink_errors"] == "n/a"


def test_the_worst_finding_sets_the_category_and_severity():
    result = checkup(nvmlDeviceGetTemperature=lambda sensor: 90, nvmlDeviceGetRemappedRows=(0, 9, 0, 1))
    assert health.worst(result.findings) == ("gpu-hardware", "isolate")
    assert health.worst([]) is None
    with pytest.raises(ValueError, match="severity"):
        health.Finding(0, "GPU-0", "x", "a", "b", "gpu-hardware", "panic", "none")


def test_pcie_generation_is_judged_under_load_only():
    gpu = topology.read_gpu(h200_nvml(), 0, NO_SYSFS)
    assert hardware.findings(gpu, [gpu]) == []  # gen1 at rest is an idle link, not a fault
    assert hardware.pcie_under_load(gpu, 5, 16) is None
    downtrained = hardware.pcie_under_load(gpu, 4, 16)
    assert (downtrained.expected, downtrained.found) == ("gen5 x16 (the GPU's own max)",
                                                         "gen4 x16 while copying (downtrained)")
    assert hardware.pcie_under_load(gpu, 5, 8).category == "interconnect"
    assert hardware.pcie_under_load(gpu, None, None) is None
    errors = {}
    assert health.pcie_link_now(h200_nvml(nvmlDeviceGetCurrPcieLinkGeneration=5), "h", errors) == (5, 16)
    assert health.pcie_link_now(h200_nvml(nvmlDeviceGetCurrPcieLinkGeneration=Fails(
        pynvml.NVML_ERROR_TIMEOUT)), "h", errors) == (None, 16)
    assert errors == {"current PCIe generation": "NVML error Timeout"}


def test_a_link_ramping_up_from_idle_is_not_downtrained_but_one_that_stays_low_is():
    gpu = topology.read_gpu(h200_nvml(), 0, NO_SYSFS)
    answers = iter([1, 3, 5])
    ramping = h200_nvml(nvmlDeviceGetCurrPcieLinkGeneration=lambda: next(answers))
    assert health.pcie_link_under_load(ramping, "h", {}, bars.pcie_expected(gpu), pause_s=0) == (5, 16)
    stuck = h200_nvml(nvmlDeviceGetCurrPcieLinkGeneration=4)
    gen, width = health.pcie_link_under_load(stuck, "h", {}, bars.pcie_expected(gpu), pause_s=0)
    assert hardware.pcie_under_load(gpu, gen, width).found == "gen4 x16 while copying (downtrained)"


def _gpu_with_local_cpus(root: Path, cpulist: str) -> str:
    (root / "0000:17:00.0").mkdir(parents=True)
    (root / "0000:17:00.0" / "local_cpulist").write_text(cpulist + "\n")
    return "00000000:17:00.0"


def test_host_copies_allocate_on_the_gpus_numa_node_and_the_thread_goes_back(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    gpu = _gpu_with_local_cpus(tmp_path, f"{mine[-1]}-{mine[-1]},{max(mine) + 64}")  # one CPU of ours, one not
    with topology.near(gpu, str(tmp_path)) as cpus:
        assert cpus == {mine[-1]} and os.sched_getaffinity(0) == {mine[-1]}
    assert sorted(os.sched_getaffinity(0)) == mine


def test_no_numa_node_in_sysfs_leaves_the_thread_where_it_runs(tmp_path):
    before = os.sched_getaffinity(0)
    foreign = _gpu_with_local_cpus(tmp_path, str(max(before) + 64))
    for gpu, root in ((None, str(tmp_path)), ("00000000:99:00.0", str(tmp_path)), (foreign, str(tmp_path))):
        with topology.near(gpu, root) as cpus:
            assert cpus is None and os.sched_getaffinity(0) == before


def test_a_figure_below_its_bar_or_its_peers_is_the_gpus_finding_and_an_unread_one_is_never_a_pass():
    """judge/per_gpu.py from recorded readings (the fast tier's HBM, copies and GEMM checks hand these over)."""
    spec, none, pcie = bars.Bar(3.37e12, "H200 spec"), bars.Bar(None, "no bar"), bars.Bar(44.1e9, "PCIe gen5 x16")
    assert per_gpu.below_bar(0, "GPU-a", "device copy", 3.8e12, spec, 1e12, "TB/s", "fix") == []
    assert per_gpu.below_bar(0, "GPU-a", "device copy", 3.0e12, none, 1e12, "TB/s", "fix") == []
    [slow] = per_gpu.below_bar(1, "GPU-b", "pinned host-to-device copy", 27.8e9, pcie, 1e9, "GB/s",
                               per_gpu.COPIES_FIX, category="interconnect", digits=1)
    assert (slow.gpu_index, slow.category, slow.severity) == (1, "interconnect", "triage")
    assert (slow.expected, slow.found) == (">= 44.1 GB/s (PCIe gen5 x16)", "27.8 GB/s")
    [held] = per_gpu.below_bar(0, "GPU-a", "bf16 GEMM", 500e12, bars.Bar(642e12, "SM count x clock"), 1e12,
                               "TFLOP/s", "fix", digits=0, why=" (clocks held back: power cap)")
    assert held.found == "500 TFLOP/s (clocks held back: power cap)" and held.category == "performance"
    peers = per_gpu.below_peers(2, "GPU-c", "bf16 GEMM", 600e12, 760e12, 0.1, "NVIDIA H200 (132 SMs)", 1e12,
                                "TFLOP/s", "fix")
    assert peers.expected == "within 10% of the median 760 TFLOP/s of the job's NVIDIA H200 (132 SMs) GPUs"
    [unread] = per_gpu.unread(0, "GPU-a", {"PCIe link under load": "NVML_ERROR_TIMEOUT"}, "interconnect", "fix")
    assert (unread.found, unread.category) == ("n/a: NVML_ERROR_TIMEOUT", "interconnect")
