"""Baselines, judged: which figures are a GPU's own measurements, how much each may vary (from the spread of the
known-good runs, with a floor per unit), and which rank's figures fell below it. Pure functions of report.json
dicts; the files are read and written by stackproof/report/baseline.py. docs/baseline.md.

A figure is compared when it is a number whose unit says which way is better (UNIT_BETTER) and it measures the
rank's own GPU (or CPU rank). Everything else is left out: digests, versions, counts and sizes are the other
checks' to judge; bars are not measurements; and a figure that measures the others (NOT_OWN) would blame the
wrong rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from stackproof.judge.findings import Finding

# Which way is better, by unit: the one place that says it.
UNIT_BETTER = {**dict.fromkeys(("GB/s", "TB/s", "MB/s", "TFLOP/s", "GFLOP/s", "img/s"), "higher"),
               **dict.fromkeys(("us", "ms", "s"), "lower")}
# The least a figure of this unit may vary before it is worse, whatever the known-good runs' spread: healthy
# H200s (different GPUs of one model) read the bf16 GEMM at 711-786 TFLOP/s, HBM and host<->device copies within
# 1 % and 0.3 %; a baseline made on one GPU must pass its healthy siblings. Timings vary the most.
TOLERANCE_FLOOR = {**dict.fromkeys(("GB/s", "TB/s", "MB/s"), 0.03), **dict.fromkeys(("TFLOP/s", "GFLOP/s"), 0.10),
                   "img/s": 0.05, **dict.fromkeys(("us", "ms", "s"), 0.10)}
# The tolerance from the spread: this many robust standard deviations (1.4826 x the median absolute deviation,
# which one outlying run does not move) as a fraction of the median.
SPREAD_SIGMAS = 3.0
MAD_TO_SIGMA = 1.4826
# Figures that do not measure the rank's own GPU, and why a baseline of them would blame the wrong rank.
NOT_OWN = {
    "wait": "how long a rank waited for the others: when one rank is slow, the healthy ones wait longest",
    "barrier": "a barrier's time on a rank is mostly waiting for the others: the last to arrive waits least",
    "compile": "torch.compile's seconds depend on whether its kernels came from the cache, not on the GPU",
    "slowest_exchange": "a pair's bandwidth: a slow peer or link lowers it on the healthy rank as well",
    "slowest_pair": "the job's slowest pair: a slow peer or link lowers it on every rank",
}
KEY_FIELDS = ("gpu", "ranks_per_node", "nodes", "link")
WORSE_FIX = ("a figure fell below the machine's own known-good runs: compare the node's GPUs, links and clocks with "
             "a good node; if the change is intended (new image, new driver), make the baseline again")


def is_bar(name: str) -> bool:
    """A pass bar the run derived (from NVML or a flag), or the job's median it holds each GPU or rank to: not a
    measurement of one machine (the GPUs' own figures are compared; a median would blame every rank for one)."""
    return name in ("threshold", "median", "bar") or name.endswith("_bar") or name.startswith("median_")


def comparable(name: str, figure: dict[str, Any]) -> bool:
    """A measured number whose unit says which way is better (what the HTML page plots per rank)."""
    value = figure.get("value")
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and figure.get("unit") in UNIT_BETTER
            and not is_bar(name))


def per_rank_figures(report: dict[str, Any], own_only: bool = False
                     ) -> dict[int, dict[str, dict[str, dict[str, Any]]]]:
    """rank -> check -> figure -> {"value", "unit"}: each rank's comparable figures (`own_only`: only those that
    measure the rank's own GPU, what a baseline holds). A rank whose figures
    equal rank 0's has none of its own in report.json (rank_figures), so it gets rank 0's. Per-GPU figures that
    rank 0 records for every GPU (`hbm@host:gpu`) become the figure `hbm` of the rank on that host and GPU."""
    ranks = report.get("ranks") or [{"rank": r} for r in range(int(report.get("world", {}).get("size", 1)))]
    out: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for ident in ranks:
        rank = int(ident["rank"])
        gpu = ident.get("gpu") or {}
        own = f"{ident.get('host', '')}:{gpu.get('index', '')}"
        mine: dict[str, dict[str, dict[str, Any]]] = {}
        for check in report.get("checks", []):
            figures = check.get("figures", {})
            if rank:
                figures = check.get("rank_figures", {}).get(str(rank), figures)
            kept = {}
            for name, figure in figures.items():
                base, at, where = name.partition("@")
                if at and ":" in where:  # a per-GPU figure: only the one of this rank's GPU is this rank's
                    if where != own:
                        continue
                    name = base
                if comparable(name, figure) and not (own_only and name in NOT_OWN):
                    kept[name] = figure
            if kept:
                mine[check["name"]] = kept
        out[rank] = mine
    return out


def _link(context: dict[str, Any]) -> str:
    """NVLink or PCIe when the report says so (the NCCL transport check, or the derived busbw bar), else ''."""
    transport = context.get("nccl_transport") or {}
    if transport.get("nvlink_up"):
        return "NVLink"
    source = str((context.get("busbw_threshold") or {}).get("source", ""))
    return next((link for link in ("NVLink", "PCIe") if f"({link} " in source), "")


def key_of(report: dict[str, Any]) -> dict[str, Any]:
    """What makes figures comparable: GPU model ("cpu" on CPU runs), ranks (GPUs) per node, nodes, link."""
    models = sorted({(r.get("gpu") or {}).get("name") or "cpu" for r in report.get("ranks", [])}) or ["cpu"]
    world = report.get("world", {})
    return {"gpu": "+".join(models), "ranks_per_node": world.get("local_world_size"), "nodes": world.get("nodes"),
            "link": _link(report.get("context", {}))}


def key_text(key: dict[str, Any]) -> str:
    link = f", {key['link']}" if key.get("link") else ""
    return f"{key['gpu']}, {key['ranks_per_node']} rank(s)/node, {key['nodes']} node(s){link}"


def keys_text(entries: Iterable[dict[str, Any]]) -> str:
    return "; ".join(key_text(e["key"]) for e in entries)


def matches(entry_key: dict[str, Any], key: dict[str, Any]) -> bool:
    """Equal on every field; the link only where both know it (a run without the NCCL transport check)."""
    return all(entry_key.get(f) == key.get(f) for f in KEY_FIELDS if f != "link") and (
        not entry_key.get("link") or not key.get("link") or entry_key["link"] == key["link"])


def entry_for(baseline: dict[str, Any], key: dict[str, Any]) -> dict[str, Any] | None:
    return next((e for e in baseline["entries"] if matches(e["key"], key)), None)


def summary(values: Sequence[float], unit: str) -> dict[str, Any]:
    """A figure's baseline from its known-good samples: the median, the spread (median absolute deviation) and
    the tolerance they give, never below the unit's floor."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    spread = SPREAD_SIGMAS * MAD_TO_SIGMA * mad / abs(median) if median else 0.0
    return {"median": median, "unit": unit, "better": UNIT_BETTER[unit], "samples": len(values),
            "mad": round(mad, 6), "tolerance": round(max(TOLERANCE_FLOOR[unit], spread), 4)}


def tolerance_of(figure: dict[str, Any], override: float | None) -> float:
    """The tolerance a figure is held to: the flag's when given, else the figure's own (a file made before
    tolerances were derived: the unit's floor)."""
    if override is not None:
        return override
    return float(figure.get("tolerance") or TOLERANCE_FLOOR[figure["unit"]])


def worse(found: float, median: float, better: str, tolerance: float) -> bool:
    """More than `tolerance` (a fraction of the baseline) on the wrong side of it."""
    if better == "higher":
        return found < median * (1 - tolerance)
    return found > median * (1 + tolerance)


def regressions(report: dict[str, Any], entry: dict[str, Any], override: float | None = None
                ) -> tuple[int, dict[int, list[str]]]:
    """(figure values compared, rank -> what regressed). Figures of the baseline this run did not measure (a -k
    subset, a tier), or that are not a GPU's own, are not compared."""
    compared, found_worse = 0, {}
    for rank, checks in per_rank_figures(report, own_only=True).items():
        for check, figures in checks.items():
            for name, figure in figures.items():
                base = entry["figures"].get(check, {}).get(name)
                if base is None or base["unit"] != figure["unit"]:
                    continue
                compared += 1
                better = UNIT_BETTER[base["unit"]]
                tolerance = tolerance_of(base, override)
                if worse(figure["value"], base["median"], better, tolerance):
                    source = "--baseline-tolerance" if override is not None else "from the known-good runs' spread"
                    found_worse.setdefault(rank, []).append(
                        f"{check} {name}: found {figure['value']:g} {figure['unit']}, baseline {base['median']:g} "
                        f"{base['unit']} (median of {base.get('samples', '?')}; {better} is better), tolerance "
                        f"{tolerance:.0%} ({source})")
    return compared, found_worse


def worse_findings(lines: Iterable[str], gpu_index: int | None) -> list[Finding]:
    """One finding for each figure of a rank that regressions found worse than its baseline."""
    return [Finding(gpu_index, "", "figures against --baseline", "each figure within its tolerance of the "
                    "known-good runs' median", line, "performance", "triage", WORSE_FIX) for line in lines]
