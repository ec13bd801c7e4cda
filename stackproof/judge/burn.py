"""The burn-in soak, judged over time rather than on its peak: pure functions from one GPU's per-second samples
(stackproof/measure/burn.py) to findings that name the GPU, the second of the soak, and its temperature and
clocks at that second.

The soak's seconds, for throughput (other rules look at every second):
  ramp     the first RAMP_SHARE (at least 1 s): clocks and power climb (a healthy H200 runs its first ~200
           GEMMs at 525 TFLOP/s and 300 W), not judged for throughput;
  first    the next FIRST_SHARE (at least 1 s): the GPU's own first sustained seconds, what it sags from;
  last     the last LAST_SHARE (at least 1 s): what it sustains, against the bar and its peers.
Each window's figure is the median of its seconds (one slow second is noise, a slow window is not).

The rules:
  sustained bar   last >= fraction (--burn-fraction, 0.5) x the dense bf16 peak at the GPU's max SM clock
                  (judge/bars.py). Measured on a healthy H200 (700 W limit): 660-668 TFLOP/s sustained at
                  690-694 W, SM 1425-1485 MHz, 0.62 of its 1070 TFLOP/s peak; 0.5 (535 TFLOP/s) leaves 19 % below
                  that and sits above the ramp's 525 (a GPU whose clocks never ramp fails). The bar comes from
                  what the GPU should have: a lowered power limit lowers the figure, never the bar (the node spec
                  names the limit). With `validate --baseline` the sustained figure (`burn_sustained`) is also
                  held to the median of known-good burn runs of the model (judge/baseline.py, 10 % for TFLOP/s).
  sag             last >= (1 - sag) x first (--burn-sag, 0.10 on GPUs; the healthy H200 above sagged < 2 %
                  while heating from 57 to 64 C); named at the second it fell and stayed below.
  peers           last within --gpu-spread (0.10) of the median of the node's GPUs of the model.
  clocks          HW slowdown, HW or SW thermal slowdown or HW power brake in any second's clock-event reasons
                  (a software power cap, 0x4, is how a healthy GPU holds its power limit: not a finding).
  temperature     every second below the GPU's max operating temperature (NVML's GPU_MAX threshold, else its
                  slowdown threshold).
  known answers   every known-answer GEMM, memory pattern word and copied word right, at every second.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from stackproof.judge import bars
from stackproof.judge.findings import RMA, Finding
from stackproof.judge.health import CLOCK_TROUBLE, COOLING

RAMP_SHARE, FIRST_SHARE, LAST_SHARE = 0.10, 0.10, 0.25
SAG_GPU = 0.10
THROUGHPUT_HINT = ("check cooling, power and clocks on the GPU named (nvidia-smi -q -d PERFORMANCE,CLOCK,POWER,"
                   "TEMPERATURE) and that nothing else ran on it; a GPU that cannot hold its rate while hot is "
                   "for the vendor's diagnostic (dcgmi diag -r 3)")


def windows(count: int) -> tuple[slice, slice, slice]:
    """(ramp, first, last) over `count` one-second samples (indices into them)."""
    ramp = max(1, round(RAMP_SHARE * count))
    first = max(1, round(FIRST_SHARE * count))
    last = max(1, round(LAST_SHARE * count))
    return slice(0, ramp), slice(ramp, min(count, ramp + first)), slice(max(0, count - last), count)


def rates(samples: Sequence[dict]) -> list[float]:
    """TFLOP/s per second; a second in which no GEMM finished counts as 0 (the GPU stalled)."""
    return [s.get("tflops") or 0.0 for s in samples]


def seconds_of(window: slice, samples: Sequence[dict]) -> str:
    chosen = samples[window]
    return f"{chosen[0]['t']}-{chosen[-1]['t']}" if chosen else "none"


def sustained(samples: Sequence[dict]) -> dict:
    """The first sustained seconds' and the last part's median TFLOP/s, and which seconds they are."""
    _, first, last = windows(len(samples))
    values = rates(samples)
    return {"first": round(statistics.median(values[first]), 4) if values[first] else None,
            "last": round(statistics.median(values[last]), 4) if values[last] else None,
            "first_seconds": seconds_of(first, samples), "last_seconds": seconds_of(last, samples)}


def sustained_bar(sm_count: int, max_sm_clock_mhz: int | None, compute_capability: tuple[int, int],
                  fraction: float) -> bars.Bar:
    bar = bars.gemm_bar(sm_count, max_sm_clock_mhz, compute_capability, fraction)
    return bars.Bar(bar.value, bar.source if bar.value is None else f"sustained: {bar.source}")


def moment(sample: dict | None, total: int) -> str:
    """'second 23 of 60: 63 C, SM 1455 MHz, memory 3201 MHz, 692 W, clock-event reasons 0x4'."""
    if sample is None:
        return "no sample"
    said = [f"{sample['temp_c']} C" if sample.get("temp_c") is not None else "",
            f"SM {sample['sm_mhz']} MHz" if sample.get("sm_mhz") is not None else "",
            f"memory {sample['mem_mhz']} MHz" if sample.get("mem_mhz") is not None else "",
            f"{sample['power_w']:g} W" if sample.get("power_w") is not None else "",
            f"clock-event reasons {hex(sample['reasons'])}" if sample.get("reasons") is not None else "",
            f"{sample['tflops']:.4g} TFLOP/s" if sample.get("tflops") is not None else ""]
    readings = ", ".join(s for s in said if s)
    return f"second {sample['t']} of {total}" + (f" ({readings})" if readings else "")


def _sample_at(samples: Sequence[dict], second: int) -> dict | None:
    return next((s for s in samples if s["t"] == second), samples[-1] if samples else None)


def _finding(gpu: int | None, uuid: str, check: str, expected: str, found: str, category: str, severity: str,
             action: str) -> Finding:
    return Finding(gpu, uuid, check, expected, found, category, severity, action)


# --- Known answers -------------------------------------------------------------------------------------------------

WRONG_HOW = {  # what came back wrong -> (category, severity, fix)
    "known-answer GEMM": ("gpu-hardware", "isolate", "a GPU that computes wrong under sustained load must not train: "
                          "drain the node, run the vendor's diagnostic (dcgmi diag -r 3); " + RMA),
    "memory pattern": ("gpu-hardware", "isolate", "device memory that does not hold its data: drain the node, check "
                       "the remapped rows (nvidia-smi -q -d ROW_REMAPPER) after a reset; " + RMA),
    "host-to-device copy": ("interconnect", "isolate", "data corrupted between host and GPU: drain the node, check "
                            "the PCIe link (lspci -vv: AER errors), the riser and host memory (ECC)"),
    "device-to-host copy": ("interconnect", "isolate", "data corrupted between GPU and host: drain the node, check "
                            "the PCIe link (lspci -vv: AER errors), the riser and host memory (ECC)"),
}


def wrong_answers(gpu: int | None, uuid: str, wrong: Sequence[dict], samples: Sequence[dict],
                  total: int) -> list[Finding]:
    """One finding per kind (and dtype) of wrong answer, at the first second it came back wrong."""
    found, seen = [], {}
    for event in wrong:
        seen.setdefault((event["what"], event.get("dtype", "")), []).append(event)
    for (what, dtype), events in seen.items():
        first = events[0]
        category, severity, action = WRONG_HOW[what]
        label = f"{what} ({dtype})" if dtype else what
        found.append(_finding(gpu, uuid, f"burn-in {label}", "the known answer at every second of the soak",
                              f"{first['found']} at {moment(_sample_at(samples, first['t']), total)}"
                              + (f"; wrong {len(events)} times in all" if len(events) > 1 else ""),
                              category, severity, action))
    return found


# --- Throughput over time ------------------------------------------------------------------------------------------

def sag_onset(samples: Sequence[dict], floor: float) -> dict | None:
    """The first second after the first sustained seconds from which the rate fell below `floor` and the rest of
    the soak stayed below it (its median), or None."""
    _, first, _ = windows(len(samples))
    values = rates(samples)
    for i in range(first.stop, len(samples)):
        if values[i] < floor and statistics.median(values[i:]) < floor:
            return samples[i]
    return None


def throughput(gpu: int | None, uuid: str, samples: Sequence[dict], bar: bars.Bar, sag: float | None,
               total: int) -> list[Finding]:
    """The last part against the sustained bar, and against the GPU's own first sustained seconds (`sag` None:
    not judged, a CPU rank's shared cores)."""
    figures = sustained(samples)
    last, first = figures["last"], figures["first"]
    found = []
    if last is None:
        return [_finding(gpu, uuid, "burn-in throughput", "a throughput sample every second", "no sample",
                         "gpu-hardware", "triage", THROUGHPUT_HINT)]
    _, _, last_window = windows(len(samples))
    if bar.value is not None and last * 1e12 < bar.value:
        slowest = min(samples[last_window], key=lambda s: s.get("tflops") or 0.0)
        found.append(_finding(gpu, uuid, "burn-in sustained throughput",
                              f">= {bar.value / 1e12:.4g} TFLOP/s over the last part ({bar.source})",
                              f"{last:.4g} TFLOP/s over seconds {figures['last_seconds']}; slowest "
                              f"{moment(slowest, total)}", "performance", "triage", THROUGHPUT_HINT))
    if sag is not None and first:
        floor = (1 - sag) * first
        if last < floor:
            onset = sag_onset(samples, floor) or min(samples[last_window], key=lambda s: s.get("tflops") or 0.0)
            found.append(_finding(gpu, uuid, "burn-in throughput sag",
                                  f"the last part within {sag:.0%} of its own first sustained seconds "
                                  f"{figures['first_seconds']} ({first:.4g} TFLOP/s): >= {floor:.4g} TFLOP/s",
                                  f"{last:.4g} TFLOP/s over seconds {figures['last_seconds']} "
                                  f"({last / first - 1:+.0%}), below from {moment(onset, total)}",
                                  "performance", "triage", THROUGHPUT_HINT))
    return found


def behind_peers(gpu: int | None, uuid: str, samples: Sequence[dict], median: float, spread: float, model: str,
                 total: int) -> list[Finding]:
    """The last part against the median of the node's (job's) GPUs of the model (TFLOP/s)."""
    figures = sustained(samples)
    if figures["last"] is None or figures["last"] >= (1 - spread) * median:
        return []
    _, _, last_window = windows(len(samples))
    slowest = min(samples[last_window], key=lambda s: s.get("tflops") or 0.0)
    return [_finding(gpu, uuid, "burn-in sustained throughput vs peers",
                     f"within {spread:.0%} of the median {median:.4g} TFLOP/s of the job's {model} GPUs",
                     f"{figures['last']:.4g} TFLOP/s over seconds {figures['last_seconds']}; slowest "
                     f"{moment(slowest, total)}", "performance", "triage", THROUGHPUT_HINT)]


# --- Clocks and temperature ----------------------------------------------------------------------------------------

def clocks(gpu: int | None, uuid: str, samples: Sequence[dict], total: int) -> list[Finding]:
    """Heat or power holding the clocks back at any second: one finding per reason, at its first second."""
    found = []
    for bit, (name, action) in CLOCK_TROUBLE.items():
        hit = [s for s in samples if s.get("reasons") is not None and s["reasons"] & bit]
        if hit:
            found.append(_finding(gpu, uuid, "burn-in clock-event reasons", f"no {name} at any second of the soak",
                                  f"{name} from {moment(hit[0], total)}; in {len(hit)} of {len(samples)} seconds",
                                  "gpu-hardware", "triage", action))
    return found


def temperature(gpu: int | None, uuid: str, samples: Sequence[dict], max_temp_c: int | None,
                total: int) -> list[Finding]:
    if not max_temp_c:
        return []
    hot = [s for s in samples if s.get("temp_c") is not None and s["temp_c"] >= max_temp_c]
    if not hot:
        return []
    hottest = max(hot, key=lambda s: s["temp_c"])
    return [_finding(gpu, uuid, "burn-in temperature", f"below the GPU's max operating temperature {max_temp_c} C "
                     "at every second", f"{hot[0]['temp_c']} C from {moment(hot[0], total)}; hottest "
                     f"{hottest['temp_c']} C; in {len(hot)} of {len(samples)} seconds", "gpu-hardware", "triage",
                     COOLING)]


def peak(samples: Sequence[dict], key: str) -> float | int | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return max(values) if values else None


def reasons_seen(samples: Sequence[dict]) -> int | None:
    values = [s["reasons"] for s in samples if s.get("reasons") is not None]
    if not values:
        return None
    seen = 0
    for value in values:
        seen |= value
    return seen


GEMM_FIX = "drain the node and run the GPU vendor's diagnostic (dcgmi diag -r 3) on the GPU named"
DATA_FIX = ("drain the node; for memory: nvidia-smi -q -d ROW_REMAPPER after a GPU reset; for copies: the PCIe link's "
            "AER errors (lspci -vv) and the host's memory ECC")


def too_short(what: str, ended: str) -> Finding:
    """A soak that ended before anything was checked: said of its own length, never of the GPU (a GPU that stalled
    is the throughput check's and the watchdog's to name): an alert, never a drain."""
    return Finding(None, "", "soak length", f"a soak long enough for {what}", ended,
                   "configuration", "triage", f"raise --burn-seconds: the soak must last long enough for {what} "
                                              "on this host")
