"""Print the burn-in series of one or more reports (report.json's burn_series and burn_bars tables): for each GPU,
one line per STEP seconds (throughput, power, temperature, SM and memory clocks, clock-event reasons) and its
windows against the bars. Usage: python benchmarks/burn_series.py [--step S] REPORT_OR_DIR..."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summary(path: Path, step: int) -> list[str]:
    report = json.loads((path / "report.json" if path.is_dir() else path).read_text())
    tables = report.get("tables", {})
    lines = [f"# {path}: {report.get('verdict')} (exit {report.get('exit_code')}), wall "
             f"{report.get('wall_time_s') or 0:.1f} s"]
    for bars in tables.get("burn_bars", []):
        lines.append(f"# rank {bars['rank']} GPU {bars['gpu']} {bars['model']}: first (s {bars['first_seconds']}) "
                     f"{bars['first_tflops']} TFLOP/s, last (s {bars['last_seconds']}) {bars['last_tflops']} TFLOP/s; "
                     f"bar {bars['bar_tflops']}, sag floor {bars['sag_floor_tflops']}; power limit "
                     f"{bars.get('power_limit_w')} W, max operating {bars.get('max_temp_c')} C; soak "
                     f"{bars['seconds']} s, {bars['gemms']} GEMMs, {bars['checked']} checked")
        lines.append("#     t  TFLOP/s       W     C  SM MHz  mem MHz  reasons  checked")
        for s in (r for r in tables.get("burn_series", []) if r["rank"] == bars["rank"]):
            if s["t"] % step == 0 or s["t"] == 1:
                reasons = "-" if s.get("reasons") is None else hex(s["reasons"])
                lines.append(f"  {s['t']:>5} {s['tflops'] or 0:>8.4g} {s.get('power_w') or 0:>7.1f} "
                             f"{s.get('temp_c') or 0:>5} {s.get('sm_mhz') or 0:>7} {s.get('mem_mhz') or 0:>8} "
                             f"{reasons:>8} {s['checked']:>8}")
    for check in report.get("checks", []):
        if check.get("outcome") == "failed":
            lines.append(f"# FAIL {check['name']}: {check['message'][:600]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--step", type=int, default=5, help="seconds between the lines printed")
    args = parser.parse_args()
    for path in args.reports:
        print("\n".join(summary(path, args.step)))


if __name__ == "__main__":
    main()
