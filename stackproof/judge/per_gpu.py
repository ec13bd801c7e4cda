"""Cross-rank decisions about each GPU's figures, which rank 0 takes over every rank's value in rank order (the
`decide` of DistEnv.agree): the GPUs whose GEMM digest is not their model's majority, and the GPUs more than a
tolerance below their model's median. Pure, unit-tested without torch."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from stackproof.judge import consensus
from stackproof.judge.bars import Bar
from stackproof.judge.findings import Finding

HBM_FIX = "check the clock-event reasons (health_history) and nvidia-smi -q -d PERFORMANCE,CLOCK on the GPU"
COPIES_FIX = ("check the link (lspci -vv: LnkSta vs LnkCap), the slot's BIOS settings, and that the rank runs on the "
              "GPU's NUMA node (nvidia-smi topo -m)")
GEMM_FIX = ("check cooling, power and clocks on the GPU named (nvidia-smi -q -d PERFORMANCE,CLOCK,POWER), and that "
            "nothing else runs on it (nvidia-smi)")
COMPUTES_WRONG = ("drain the node and run the GPU vendor's diagnostic (dcgmi diag -r 3) on the GPU named; a GPU that "
                  "computes wrong must not train")


def odd_ones_out(values: list, trusted: list[bool] | None = None) -> list[int]:
    """The positions whose value is not the majority's; every position when there is no majority (1 against 1)."""
    return consensus.odd_ones_out(values, trusted, tie_goes_to_rank_0=False)


def below_median(values: list[float], tolerance: float) -> list[int]:
    """The positions more than `tolerance` (a fraction) below the median of all."""
    if not values:
        return []
    floor = (1 - tolerance) * statistics.median(values)
    return [i for i, value in enumerate(values) if value < floor]


def _by_model(entries: list[dict]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, entry in enumerate(entries):
        groups.setdefault(entry["model"], []).append(rank)
    return groups


def odd_ones_out_by_model(entries: list[dict]) -> dict:
    """entries: every rank's {"model", "digest", "exact": bool}. Within each model, the ranks whose digest is not
    the majority's; only ranks whose exact GEMM was right vote. Returns {"odd": [{"rank", "found", "expected",
    "severity"}], "reference": {model: digest or None}} (expected None: no majority). A GPU the majority outvotes
    is to isolate; with no majority (two GPUs, 1 against 1) one of them computes wrong and which cannot be told:
    each is to triage, never both isolated for one GPU's fault."""
    odd, reference = [], {}
    for model, ranks in _by_model(entries).items():
        digests = [entries[r]["digest"] for r in ranks]
        trusted = [bool(entries[r].get("exact", True)) for r in ranks]
        reference[model] = consensus.majority(digests, trusted)
        odd += [{"rank": ranks[i], "found": digests[i], "expected": reference[model],
                 "severity": "isolate" if reference[model] is not None else "triage"}
                for i in odd_ones_out(digests, trusted)]
    return {"odd": sorted(odd, key=lambda o: o["rank"]), "reference": reference}


def below_median_by_model(entries: list[dict], tolerance: float) -> dict:
    """entries: every rank's {"model", "value"}. Within each model, the ranks more than `tolerance` below the
    model's median. Returns {"slow": [{"rank", "found", "median"}], "median": {model: median}}. A rank without a
    value (its measurement failed, and it says so itself) is left out."""
    slow, medians = [], {}
    for model, ranks in _by_model([e if e["value"] is not None else {**e, "model": None} for e in entries]).items():
        if model is None:
            continue
        values = [entries[r]["value"] for r in ranks]
        medians[model] = statistics.median(values)
        slow += [{"rank": ranks[i], "found": values[i], "median": medians[model]}
                 for i in below_median(values, tolerance)]
    return {"slow": sorted(slow, key=lambda s: s["rank"]), "median": medians}


def digest_disagrees(odd: dict, gpu_index: int, uuid: str, model: str) -> Finding:
    """This GPU's finding from odd_ones_out_by_model's entry for it: outvoted by its model's majority, to isolate;
    in a tie (no majority) one of the GPUs computes wrong and which cannot be told, to triage."""
    majority = odd["expected"]
    expected = (f"GEMM-chain digest {majority[:16]}, like the other {model} GPUs of this job" if majority is not None
                else f"one GEMM-chain digest that most {model} GPUs of this job agree on")
    return Finding(gpu_index, uuid, "GEMM digest", expected, f"{odd['found'][:16]} (bf16 + fp32 chain, fixed seed)",
                   "gpu-hardware", odd["severity"], COMPUTES_WRONG if majority is not None else
                   "rerun with a third GPU of the model: the majority names the GPU that computes wrong")


def computes_wrong(gpu_index: int, uuid: str, what: str, found: str) -> Finding:
    """A GPU whose kernel's result is not the exact answer: silent data corruption, to isolate."""
    return Finding(gpu_index, uuid, what, "the exact answer", found, "gpu-hardware", "isolate", COMPUTES_WRONG)


MEMTEST_SHORT_FIX = ("free the GPU's memory (another process holds it: nvidia-smi) and run again; if none does, the "
                     "allocator's pieces were too small: run DCGM's memory test (dcgmi diag -r 3)")


def memtest_short(gpu_index: int | None, uuid: str, tested_bytes: int, free_bytes: int, chunk_bytes: int
                  ) -> list[Finding]:
    """A memory test that could take less than half the free memory has not tested the GPU: to say, not a pass."""
    if tested_bytes >= free_bytes // 2:
        return []
    gib = 1 << 30
    return [Finding(gpu_index, uuid, "memory test coverage", f"at least half of the {free_bytes / gib:.1f} GiB free "
                    "tested", f"{tested_bytes / gib:.1f} GiB (the allocator's pieces are smaller than "
                    f"{chunk_bytes >> 20} MiB, or another process took the memory meanwhile)", "configuration",
                    "triage", MEMTEST_SHORT_FIX)]


def below_bar(gpu_index: int | None, uuid: str, what: str, value: float, bar: Bar, scale: float, unit: str, action: str,
              category: str = "performance", digits: int = 2, why: str = "") -> list[Finding]:
    """A finding when a GPU's figure is below its bar (none without a bar); `why`: what the GPU said of it (clocks
    held back)."""
    if bar.value is None or value >= bar.value:
        return []
    return [Finding(gpu_index, uuid, what, f">= {bar.value / scale:.{digits}f} {unit} ({bar.source})",
                    f"{value / scale:.{digits}f} {unit}{why}", category, "triage", action)]


def below_peers(gpu_index: int, uuid: str, what: str, value: float, median: float, tolerance: float, model: str,
                scale: float, unit: str, action: str, why: str = "") -> Finding:
    """A GPU more than `tolerance` below the median of the job's GPUs of its model (below_median_by_model)."""
    return Finding(gpu_index, uuid, what, f"within {tolerance:.0%} of the median {median / scale:.0f} {unit} of the "
                   f"job's {model} GPUs", f"{value / scale:.0f} {unit}{why}", "performance", "triage", action)


def unread(gpu_index: int, uuid: str, errors: Mapping[str, str], category: str, action: str) -> list[Finding]:
    """NVML readings a check needed and could not take: each a finding of the check's class, never a pass."""
    return [Finding(gpu_index, uuid, what, "NVML's reading", f"n/a: {error}", category, "triage", action)
            for what, error in errors.items()]
