"""The burn-in tier's pieces without a GPU: the rules of stackproof/judge/burn.py on series shaped like a healthy
H200's soak (measured: tests/fault_plugins/prove_burn.sh) and on faulty ones; the soak of
stackproof/measure/burn.py run for real on the CPU beneath a fake NVML whose thermal slowdown appears late; the
settings; the tier's promise; and the HTML page's charts."""

import re

import pytest
import torch

from stackproof.errors import ConfigError
from stackproof.judge import bars
from stackproof.judge import burn as rules
from stackproof.measure import burn
from stackproof.run.config import ValidateConfig

H200_BAR = rules.sustained_bar(132, 1980, (9, 0), 0.5)  # 535 TFLOP/s


def series(seconds=60, tflops=720.0, temp=(62, 67), reasons=0x4, change=None):
    """A soak like the healthy H200's: a short ramp, then `tflops` at ~690 W, warming from temp[0] to temp[1].
    `change(t, sample)` alters a second."""
    out = []
    for t in range(1, seconds + 1):
        sample = {"t": t, "tflops": 525.0 if t == 1 else tflops, "power_w": 690.0,
                  "temp_c": temp[0] + (temp[1] - temp[0]) * t // seconds, "sm_mhz": 1485, "mem_mhz": 3201,
                  "reasons": reasons, "checked": 16, "wrong": 0}
        if change:
            change(t, sample)
        out.append(sample)
    return out


def test_windows_leave_a_ramp_and_take_the_first_and_last_seconds():
    assert rules.windows(60) == (slice(0, 6), slice(6, 12), slice(45, 60))
    assert rules.windows(5) == (slice(0, 1), slice(1, 2), slice(4, 5))  # the floor: a sample each
    figures = rules.sustained(series())
    assert figures == {"first": 720.0, "last": 720.0, "first_seconds": "7-12", "last_seconds": "46-60"}


def test_a_healthy_h200_soak_has_no_finding():
    samples = series()
    assert H200_BAR.value == pytest.approx(535.3e12, rel=1e-3) and H200_BAR.source.startswith("sustained: 0.5 x")
    assert rules.throughput(0, "GPU-x", samples, H200_BAR, rules.SAG_GPU, 60) == []
    assert rules.clocks(0, "GPU-x", samples, 60) == []  # 0x4, the software power cap, is a healthy GPU's
    assert rules.temperature(0, "GPU-x", samples, 87, 60) == []
    assert rules.behind_peers(0, "GPU-x", samples, 722.0, 0.10, "H200", 60) == []
    assert rules.wrong_answers(0, "GPU-x", [], samples, 60) == []


def test_a_sag_after_a_while_is_named_at_the_second_it_fell():
    def sag(t, sample):
        if t >= 30:
            sample.update(tflops=500.0, temp_c=80, sm_mhz=1100)
    [bar, fell] = rules.throughput(3, "GPU-x", series(change=sag), H200_BAR, rules.SAG_GPU, 60)
    assert bar.check == "burn-in sustained throughput" and "500 TFLOP/s over seconds 46-60" in bar.found
    assert fell.check == "burn-in throughput sag" and fell.gpu_index == 3 and fell.category == "performance"
    assert "first sustained seconds 7-12 (720 TFLOP/s): >= 648 TFLOP/s" in fell.expected
    assert fell.found.startswith("500 TFLOP/s over seconds 46-60 (-31%), below from second 30 of 60 (80 C, SM "
                                 "1100 MHz, memory 3201 MHz, 690 W, clock-event reasons 0x4, 500 TFLOP/s)")


def test_a_dip_that_recovers_is_no_sag_and_a_stalled_second_counts_as_zero():
    def dip(t, sample):
        if 20 <= t < 25:
            sample["tflops"] = 300.0
    assert rules.throughput(0, "GPU-x", series(change=dip), H200_BAR, rules.SAG_GPU, 60) == []

    def stalled(t, sample):
        if t > 40:
            sample["tflops"] = None  # no GEMM finished in these seconds
    [bar, sag] = rules.throughput(0, "GPU-x", series(change=stalled), H200_BAR, rules.SAG_GPU, 60)
    assert "0 TFLOP/s over seconds 46-60" in bar.found and "below from second 41 of 60" in sag.found


def test_no_bar_and_no_sag_judge_nothing_about_throughput():
    cpu = bars.Bar(None, "no GPU bar on CPU ranks")
    assert rules.throughput(None, "", series(tflops=0.01), cpu, None, 60) == []


def test_a_late_thermal_slowdown_and_a_hot_gpu_are_named_at_their_first_second():
    def hot(t, sample):
        if t >= 41:
            sample.update(reasons=0x44, temp_c=88)
    samples = series(change=hot)
    [thermal] = rules.clocks(1, "GPU-x", samples, 60)
    assert thermal.found.startswith("HW thermal slowdown from second 41 of 60 (88 C, SM 1485 MHz")
    assert thermal.found.endswith("in 20 of 60 seconds") and thermal.category == "gpu-hardware"
    [temperature] = rules.temperature(1, "GPU-x", samples, 87, 60)
    assert temperature.found.startswith("88 C from second 41 of 60") and "max operating temperature 87 C" in \
        temperature.expected
    assert rules.reasons_seen(samples) == 0x44 and rules.peak(samples, "temp_c") == 88


def test_wrong_answers_are_one_finding_per_kind_at_their_first_second():
    wrong = [{"t": 12, "what": "known-answer GEMM", "dtype": "bfloat16", "found": "1 of 8192 rows wrong"},
             {"t": 13, "what": "known-answer GEMM", "dtype": "bfloat16", "found": "2 of 8192 rows wrong"},
             {"t": 30, "what": "memory pattern", "dtype": "", "found": "1 wrong 4-byte words"}]
    [gemm, memory] = rules.wrong_answers(2, "GPU-x", wrong, series(), 60)
    assert gemm.check == "burn-in known-answer GEMM (bfloat16)" and gemm.severity == "isolate"
    assert gemm.found.startswith("1 of 8192 rows wrong at second 12 of 60 (63 C") and "wrong 2 times" in gemm.found
    assert memory.check == "burn-in memory pattern" and "second 30 of 60" in memory.found


def test_a_gpu_behind_its_peers_is_named():
    [slow] = rules.behind_peers(5, "GPU-x", series(tflops=600.0), 720.0, 0.10, "NVIDIA H200 (132 SMs)", 60)
    assert "within 10% of the median 720 TFLOP/s of the job's NVIDIA H200 (132 SMs) GPUs" in slow.expected


class FakeNvml:
    """The calls the sampler makes, answering like a healthy H200 until the soak's first second has been sampled,
    then with HW thermal slowdown in the clock-event reasons (the fault of tests/fault_plugins/burn_faults.py,
    beneath a CPU soak). Counted in samples, not wall time: a busy machine must not move the fault's second."""
    NVML_TEMPERATURE_GPU, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_TEMPERATURE_THRESHOLD_GPU_MAX, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 3, 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, hot_after_samples):
        self.samples, self.hot_after_samples = 0, hot_after_samples

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x44 if self.samples >= self.hot_after_samples else 0x4

    def nvmlDeviceGetPowerUsage(self, handle):
        self.samples += 1  # read once a sample
        return 690_000

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 64

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return {1: 1485, 2: 3201}[clock]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlDeviceGetTemperatureThreshold(self, handle, which):
        if which == self.NVML_TEMPERATURE_THRESHOLD_GPU_MAX:  # not every GPU reports it: the slowdown one is used
            raise self.NVMLError_NotSupported()
        return 90


def test_the_soak_samples_every_second_and_a_late_thermal_reading_is_named():
    nvml = FakeNvml(hot_after_samples=1)
    plan = burn.SoakPlan(3.0, n=64, load_gemms=2, memory_bytes=1 << 20, memory_chunk_bytes=1 << 18,
                         copy_bytes=1 << 18)
    soak = burn.soak(torch.device("cpu"), plan, burn.Sampler(nvml, handle=object()))
    assert [s["t"] for s in soak.samples] == [1, 2, 3] and not soak.wrong and soak.checked
    assert all(s["power_w"] == 690.0 and s["sm_mhz"] == 1485 and s["checked"] for s in soak.samples)
    assert soak.limits == {"power_limit_w": 700.0, "max_temp_c": 90}
    assert soak.memory_bytes_checked and soak.copy_bytes_checked and soak.dtypes == ["bfloat16", "float16"]
    [thermal] = rules.clocks(0, "GPU-x", soak.samples, 3)
    # from second 2, or 3 where a busy machine read no batch back in second 2; never second 1
    assert re.search(r"HW thermal slowdown from second [23] of 3", thermal.found), thermal.found


def test_the_known_answer_gemm_sees_one_wrong_element():
    check = burn.KnownAnswerGemm(torch.device("cpu"), 64, torch.bfloat16, seed=1)
    assert check.issue().tolist() == [0, 64]
    real = check.product
    check.product = lambda: real().index_put_((torch.tensor([5]), torch.tensor([7])), torch.tensor(1.0,
                                              dtype=torch.bfloat16), accumulate=True)
    assert check.issue().tolist() == [1, 5]


def test_a_memory_chunk_that_changed_is_counted():
    memory = burn.MemoryPattern(torch.device("cpu"), 1 << 16, 1 << 14)
    for visit in range(memory.chunks):  # the first lap only writes
        assert memory.issue(visit)[0] is None
    memory.buffer[3] ^= 1
    wrong, checked = memory.issue(memory.chunks)
    assert int(wrong) == 1 and checked == 1 << 14


def test_a_copy_that_did_not_happen_leaves_the_other_pattern_behind():
    copies = burn.Copies(torch.device("cpu"), 1 << 12)
    wrong, landing = copies.issue(0)
    assert int(wrong) == 0 and copies.landed_wrong(0, landing) == 0
    assert copies.landed_wrong(1, landing) == 1 << 10  # batch 1's pattern expected, batch 0's found


def test_the_soak_length_is_bounded_and_fits_the_run_timeout():
    with pytest.raises(ConfigError, match="--burn-seconds: expected 5 to 3600, found 4"):
        ValidateConfig(tier="burn", burn_seconds=4)
    with pytest.raises(ConfigError, match="--burn-seconds: expected 5 to 3600"):
        ValidateConfig(tier="burn", burn_seconds=3601, run_timeout=4000)
    with pytest.raises(ConfigError, match="needs --run-timeout of at least 1820"):
        ValidateConfig(tier="burn", burn_seconds=1700)
    settings = ValidateConfig(tier="burn", burn_seconds=600)
    assert settings.watchdog_s == 300 + 10 + 600  # the soak runs inside one check


def test_the_page_draws_each_quantity_over_the_soak_with_its_bars():
    pytest.importorskip("matplotlib")
    from stackproof.report import page

    rows = [{"host": "h", "rank": r, "gpu": r, **s} for r in (0, 1) for s in series(seconds=10)]
    bars_rows = [{"host": "h", "rank": r, "gpu": r, "bar_tflops": 535.3, "sag_floor_tflops": 648.0 + r,
                  "power_limit_w": 700.0, "max_temp_c": 87} for r in (0, 1)]
    report = {"verdict": "OK", "tables": {"burn_series": rows, "burn_bars": bars_rows}, "checks": []}
    text = page.render([("run", report)])
    for column in ("tflops", "power_w", "temp_c", "sm_mhz", "mem_mhz"):
        assert f'id="burn-{column}"' in text
    assert "sustained bar 535.3 TFLOP/s" in text and "sag floor h rank 1 649" in text and "h GPU 1" in text
    assert "max operating 87 C" in text and "power limit 700 W" in text
    assert "No burn-in soak" in page.render([("run", {"verdict": "OK", "checks": []})])

