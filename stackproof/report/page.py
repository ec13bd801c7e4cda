"""`stackproof report`: one self-contained HTML page of one or more runs (docs/report-html.md).

The page reads report.json as its contract says (docs/report-format.md), by field and column name, and
tolerates fields, tables and columns it does not know. Several reports make one page: the verdict at the top is
the worst of them, the failing checks of every run come first, the busbw sweeps share one plot (to compare runs,
or the nodes of a fleet run one report per node), and each run has its own check and node tables."""

from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import Any

from stackproof import __version__, files
from stackproof.errors import ConfigError, Exit
from stackproof.judge import baseline
from stackproof.report import fleet, nccl_tests
from stackproof.report.attestation import read_record, record_line
from stackproof.report.record import REPORT_FILE, read_report, report_file

ATTESTATION = "_attestation"  # the page's own key for the record `stackproof attest` left beside a report

VERDICT_ORDER = ("OK", "INTERRUPTED", "FAILED")
# Beyond this many runs (a fleet, one report per node) the page draws the node maps instead of a chart per run and
# GPU, folds each run's tables, and names only the extreme sweeps in the legend.
FLEET_RUNS = 8
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
.verdict { padding: 0.6em 1em; font-size: 1.3em; font-weight: bold; border-radius: 4px; color: #fff; }
.OK { background: #2e7d32; } .FAILED { background: #c62828; } .INTERRUPTED { background: #ef6c00; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; vertical-align: top;
  overflow-wrap: break-word; }
.wide { overflow-x: auto; max-width: 100%; }  /* a table wider than the window scrolls, never cut */
details > summary { cursor: pointer; margin: 0.4em 0; }
th { background: #f3f3f3; } tr.FAIL td { background: #fdecea; } tr.SKIP td { color: #777; }
td.FAIL { color: #c62828; font-weight: bold; } td.PASS { color: #2e7d32; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; } .plot svg { max-width: 100%; height: auto; }
.muted { color: #777; }
""" + fleet.STYLE


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """(the label of the run, its report.json); another schema is refused, exit 2."""
    data = read_report(path)
    folder = report_file(path).parent
    attested = read_record(path if path.is_dir() else path.parent)  # stackproof attest's, beside report.json
    if attested:
        data = {**data, ATTESTATION: attested}
    node_history = fleet.read_history(folder)  # a healthcheck's copy of its node's history, beside report.json
    if node_history:
        data = {**data, fleet.HISTORY: node_history}
    nodes = ",".join(n.get("node", "?") for n in data.get("nodes", [])) or "?"
    return f"{nodes} {data.get('started', '')[:19]}", data


def _table(headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    """Cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join(f'<tr class="{(row_classes or [""] * len(rows))[i]}">' + "".join(f"<td>{c}</td>" for c in row)
                   + "</tr>" for i, row in enumerate(rows))
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _where(report: dict[str, Any], rank: int) -> str:
    ranks = report.get("ranks", [])
    ident = ranks[rank] if 0 <= rank < len(ranks) else {}
    gpu = ident.get("gpu") or {}
    gpu_text = f" GPU {gpu['index']} ({gpu.get('serial') or gpu.get('uuid', '')})" if gpu else ""
    return f"rank {rank} on {ident.get('node', '?')}{gpu_text}"


def _figures(check: dict[str, Any]) -> str:
    parts = []
    for name, figure in check.get("figures", {}).items():
        value = figure.get("value")
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{name}={text} {figure.get('unit', '')}".strip())
    return "; ".join(parts)


def _checks(report: dict[str, Any], label: str | None = None, only_failed: bool = False) -> tuple[str, int]:
    order = {"FAIL": 0, "SKIP": 2, "PASS": 1}
    checks = sorted(report.get("checks", []), key=lambda c: order.get(c.get("verdict"), 0))  # stable: run order
    rows, classes = [], []
    for check in checks:
        verdict = check.get("verdict", "?")
        if only_failed and verdict != "FAIL":
            continue
        note = check.get("message", "").splitlines()[0] if check.get("message") else ""
        if verdict == "FAIL" and check.get("failed_ranks"):
            note += " [" + "; ".join(_where(report, r) for r in check["failed_ranks"][:8]) + "]"
        fix = check.get("hint", "") if verdict == "FAIL" else ""
        row = [_e(check.get("name", "?")), f'<span class="{_e(verdict)}">{_e(verdict)}</span>',
               _e(_figures(check)), _e(note), _e(fix)]
        rows.append(([_e(label)] if label is not None else []) + row)
        classes.append(verdict)
    headers = (["run"] if label is not None else []) + ["check", "verdict", "figures", "why", "fix"]
    return _table(headers, rows, classes), len(rows)


def _nodes(report: dict[str, Any]) -> str:
    rows, classes = [], []
    for node in report.get("nodes", []):
        failed = "; ".join(f"{f['check']} (rank {', '.join(map(str, f['ranks']))})"
                           for f in node.get("failed_checks", []))
        gpus = ", ".join(str(g.get("serial") or g.get("uuid") or g.get("index")) for g in node.get("gpus", []))
        rows.append([_e(node.get("node")), _e(node.get("verdict")), _e(len(node.get("ranks", []))),
                     _e(gpus or "none (CPU)"), _e(failed)])
        classes.append(node.get("verdict", ""))
    return _table(["node", "verdict", "ranks", "GPUs (serial)", "failed checks"], rows, classes)


def _sweeps(runs: list[tuple[str, dict[str, Any]]], references: list[tuple[str, list[nccl_tests.Row]]]) -> str:
    """busbw and time against size: every run's busbw tables, the threshold, and nccl-tests runs as lines."""
    from stackproof.report import plots

    busbw, times, thresholds = [], [], []
    for label, report in runs:
        prefix = f"{label}: " if len(runs) > 1 else ""
        for name, rows in report.get("tables", {}).items():
            usable = [r for r in rows if isinstance(r, dict) and "size_bytes" in r and "busbw_gbps" in r]
            if usable:  # every busbw table: the sweep, and any other mode's (tolerating columns not known here)
                sizes = [r["size_bytes"] for r in usable]
                busbw.append((f"{prefix}{name}", sizes, [r["busbw_gbps"] for r in usable], "-"))
                if all("time_us" in r for r in usable):
                    times.append((f"{prefix}{name}", sizes, [r["time_us"] for r in usable], "-"))
        bar = report.get("context", {}).get("busbw_threshold") or {}
        if bar.get("gbps") is not None:
            thresholds.append((f"{prefix}threshold {bar['gbps']:g} GB/s ({bar.get('source', '')})", bar["gbps"]))
    for name, rows in references:
        for placement, style, pick in (("in-place", "--", lambda r: r.in_place),
                                       ("out-of-place", ":", lambda r: r.out_of_place)):
            measured = [(r.size_bytes, pick(r)) for r in rows if pick(r)]
            if measured:
                sizes = [size for size, _ in measured]
                busbw.append((f"nccl-tests {placement} ({name})", sizes, [m[2] for _, m in measured], style))
                times.append((f"nccl-tests {placement} ({name})", sizes, [m[0] for _, m in measured], style))
    if not busbw:
        return '<p class="muted">No busbw sweep in these reports (the bandwidth checks did not run).</p>'
    if len(runs) > FLEET_RUNS:
        busbw, times = _legend_extremes(busbw), _legend_extremes(times)
    html_busbw = plots.sweep(busbw, thresholds, "all_reduce bus bandwidth vs message size", "busbw (GB/s)")
    html_time = plots.sweep(times, [], "all_reduce time vs message size", "time (us, log scale)", log_y=True)
    return f'<div class="plot" id="busbw-plot">{html_busbw}</div><div class="plot" id="time-plot">{html_time}</div>'


def _legend_extremes(lines: list[tuple[str, list[int], list[float], str]], shown: int = 3
                     ) -> list[tuple[str, list[int], list[float], str]]:
    """Every line is drawn, but the legend names only the `shown` lowest and highest at the largest size
    (matplotlib leaves out labels starting with '_')."""
    order = sorted(range(len(lines)), key=lambda i: lines[i][2][-1])
    named = set(order[:shown] + order[-shown:])
    return [(label if i in named else f"_{label}", sizes, values, style)
            for i, (label, sizes, values, style) in enumerate(lines)]


def _per_gpu(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Bars per GPU (per rank on CPU) of every figure measured per GPU: the per_gpu checks', and any figure
    whose value differs between ranks."""
    from stackproof.report import plots

    charts = []
    for label, report in runs:
        per_rank = baseline.per_rank_figures(report)
        checks = {c.get("name"): c for c in report.get("checks", [])}
        names = sorted({(check, fig) for figs in per_rank.values() for check, names in figs.items()
                        for fig in names})
        for check, fig in names:
            values = [(rank, per_rank[rank][check][fig]) for rank in sorted(per_rank) if fig in
                      per_rank[rank].get(check, {})]
            if not (check.startswith("per_gpu::") or len({v["value"] for _, v in values}) > 1):
                continue
            bar = (checks.get(check, {}).get("figures", {}).get(f"{fig}_bar") or {}).get("value")
            unit = values[0][1]["unit"]
            title = f"{label}: {check} {fig}" if len(runs) > 1 else f"{check} {fig}"
            svg = plots.bars([_where(report, rank).replace(" on ", "\n") for rank, _ in values],
                             [v["value"] for _, v in values], unit, title,
                             bar if isinstance(bar, (int, float)) else None, baseline.UNIT_BETTER[unit])
            charts.append(f'<div class="plot per-gpu">{svg}</div>')
    if not charts:
        return '<p class="muted">No figure was measured per GPU or per rank in these reports.</p>'
    return f'<div class="plots">{"".join(charts)}</div>'


# The burn-in soak's quantities, one chart each (report.json's burn_series), and the burn_bars columns drawn
# as the chart's bars: (column, title, unit, bar column, bar label); a row without a title adds a bar to the
# chart of its column above.
BURN_CHARTS = (("tflops", "bf16 GEMM throughput", "TFLOP/s", "bar_tflops", "sustained bar"),
               ("tflops", "", "TFLOP/s", "sag_floor_tflops", "sag floor"),
               ("power_w", "power", "W", "power_limit_w", "power limit"),
               ("temp_c", "temperature", "C", "max_temp_c", "max operating"),
               ("sm_mhz", "SM clock", "MHz", None, ""),
               ("mem_mhz", "memory clock", "MHz", None, ""))


def _burn(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Each GPU's burn-in series over the soak: one chart per quantity, one line per GPU, with its bars."""
    from stackproof.report import plots

    charts = []
    for label, report in runs:
        series, bars_rows = report.get("tables", {}).get("burn_series"), report.get("tables", {}).get("burn_bars")
        if not series:
            continue
        gpus: dict[Any, list[dict[str, Any]]] = {}
        for row in series:
            gpus.setdefault((row.get("host"), row.get("rank")), []).append(row)

        def name(key, rows):
            gpu = rows[0].get("gpu")
            return f"{key[0]} GPU {gpu}" if gpu is not None else f"{key[0]} rank {key[1]}"

        drawn = {}
        for column, title, unit, bar_column, bar_label in BURN_CHARTS:
            if title:
                lines = [(name(key, rows), [r["t"] for r in rows if r.get(column) is not None],
                          [r[column] for r in rows if r.get(column) is not None]) for key, rows in gpus.items()]
                lines = [line for line in lines if line[1]]
                if not lines:
                    continue
                drawn[column] = {"title": title, "unit": unit, "lines": lines, "levels": []}
            if bar_column and column in drawn:
                values = {(b.get("host"), b.get("rank")): b.get(bar_column) for b in bars_rows or []}
                known = {v for v in values.values() if isinstance(v, (int, float))}
                colour = "tab:red" if bar_label != "sag floor" else "tab:orange"
                if len(known) == 1:
                    drawn[column]["levels"].append((f"{bar_label} {known.pop():.4g} {unit}", next(
                        v for v in values.values() if isinstance(v, (int, float))), colour))
                else:
                    drawn[column]["levels"] += [(f"{bar_label} {key[0]} rank {key[1]} {v:.4g}", v, colour)
                                                for key, v in values.items() if isinstance(v, (int, float))]
        for column, chart in drawn.items():
            title = f"{label}: {chart['title']}" if len(runs) > 1 else chart["title"]
            svg = plots.over_time(chart["lines"], chart["levels"], f"burn-in: {title}", chart["unit"])
            charts.append(f'<div class="plot burn" id="burn-{_e(column)}">{svg}</div>')
    if not charts:
        return '<p class="muted">No burn-in soak in these reports (--tier burn draws each GPU over the soak).</p>'
    return "".join(charts)


def _known(value: Any) -> str:
    """A count the report does not know (no rank started) shows as '-', never as None."""
    return _e(value) if value is not None else '<span class="muted">-</span>'


def _counts(report: dict[str, Any]) -> str:
    """passed / failed / skipped / not run; '-' when no rank started (no world, no check): nothing was counted."""
    if not report.get("checks") and (report.get("world") or {}).get("size") is None:
        return _known(None)
    counts = report.get("counts", {})
    return _e(" / ".join(str(counts.get(k, "?")) for k in ("passed", "failed", "skipped", "not_run")))


def _summary(runs: list[tuple[str, dict[str, Any]]]) -> str:
    table = _table(["run", "verdict", "exit code", "why", "checks (passed / failed / skipped / not run)",
                    "ranks", "nodes", "wall time"],
                   [[_e(label), _e(r.get("verdict")), _e(r.get("exit_code")), _e(r.get("message", "")),
                     _counts(r),
                     _known(r.get("world", {}).get("size")), _known(r.get("world", {}).get("nodes")),
                     _e(f"{r.get('wall_time_s') or 0:.1f} s")] for label, r in runs],
                   [("FAIL" if r.get("verdict") != "OK" else "") for _, r in runs])
    if len(runs) <= FLEET_RUNS:
        return table
    verdicts = [r.get("verdict", "FAILED") for _, r in runs]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICT_ORDER if v in verdicts)
    return f"<p>{len(runs)} runs: {_e(counts)}.</p><details><summary>Every run</summary>{table}</details>"


def _failing(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The failing checks of every run, and the runs that did not pass although no check failed (nothing ran,
    bad input, a dead rank): those say why instead."""
    failing = [_checks(report, label if len(runs) > 1 else None, only_failed=True) for label, report in runs]
    tables = "".join(table for table, count in failing if count)
    unexplained = [(label, report) for (label, report), (_, count) in zip(runs, failing, strict=True)
                   if not count and report.get("verdict") != "OK"]
    notes = "".join(f"<p><b>{_e(label)}</b>: no check failed, but the run did not pass: "
                    f"{_e(report.get('message') or report.get('exit_meaning') or 'no reason recorded')} (exit code "
                    f"{_e(report.get('exit_code'))})</p>" for label, report in unexplained)
    return tables + notes or "<p>None: every check that ran passed.</p>"


def _remedies(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Every finding's remedy (report.json's `remedies`), the cheapest step first."""
    rows, seen = [], set()
    for label, report in runs:
        for entry in report.get("remedies", []):
            gpu = entry.get("gpu_index")
            steps = entry.get("steps", [])
            row = [_e(entry.get("node") or label), _e("-" if gpu is None else gpu), _e(entry.get("check")),
                   _e(f"{entry.get('category')}, {entry.get('severity')}"), _e(entry.get("action", "")),
                   "<ol>" + "".join(f"<li><b>{_e(s.get('step'))}</b>: {_e(s.get('do'))}</li>" for s in steps) + "</ol>"]
            if tuple(row) not in seen:
                seen.add(tuple(row))
                rows.append(row)
    if not rows:
        return "<p>None: no finding.</p>"
    return _table(["node", "GPU", "check", "class", "action", "remedy (cheapest first)"], rows)


def _per_run(runs: list[tuple[str, dict[str, Any]]]) -> str:
    parts = []
    for label, report in runs:
        tables = f"<h3>{_e(label)}</h3><h4>Checks (failing first)</h4>{_checks(report)[0]}" \
                 f"<h4>Nodes</h4>{_nodes(report)}"
        if len(runs) > FLEET_RUNS:  # folded, the failing runs open
            opened = " open" if report.get("verdict") != "OK" else ""
            tables = f"<details{opened}><summary>{_e(label)}: {_e(report.get('verdict'))}</summary>{tables}</details>"
        parts.append(tables)
    return "".join(parts)


def _missing(missing: list[Path]) -> str:
    if not missing:
        return ""
    items = "".join(f"<li><b>{_e(path)}</b>: no {REPORT_FILE} there</li>" for path in missing)
    return (f'<h2 id="missing">Missing: {len(missing)} reports folder(s) without a report</h2><ul>{items}</ul>'
            '<p class="muted">Its run never started there, or its report went to another folder (its --reports): '
            "what these nodes are is not shown, and not proven.</p>")


def render(runs: list[tuple[str, dict[str, Any]]],
           references: list[tuple[str, list[nccl_tests.Row]]] = (), missing: list[Path] = ()) -> str:
    verdicts = [r.get("verdict", "FAILED") for _, r in runs] + ["FAILED"] * len(missing)  # unproven: not OK
    verdict = max(verdicts, key=lambda v: VERDICT_ORDER.index(v) if v in VERDICT_ORDER else len(VERDICT_ORDER))
    # The maps are for many nodes; runs of one node (before and after a change) compare in their own tables.
    nodes = {n.get("node") for _, r in runs for n in r.get("nodes", [])}
    maps = (f"<h2>Fleet: node &times; check</h2>{fleet.check_map(runs)}"
            f"<h2>Fleet: per-GPU figures, node &times; GPU</h2>{fleet.gpu_maps(runs)}") if len(nodes) > 1 else ""
    if len(runs) > FLEET_RUNS:
        per_gpu = (f'<p class="muted">{len(runs)} runs: each figure per GPU is drawn once for the fleet, as the node '
                   "&times; GPU maps above.</p>")
    else:
        per_gpu = _per_gpu(runs)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    title = f"stackproof report: {verdict} ({len(runs)} run{'s' if len(runs) > 1 else ''})"
    code = {"OK": Exit.OK, "INTERRUPTED": Exit.INTERRUPTED}.get(verdict, Exit.FAILED)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{_e(title)}</h1>
<div class="verdict {_e(verdict)}" id="verdict">Verdict: {_e(verdict)} ({_e(code.meaning if verdict == "OK" else
    "at least one run did not pass")})</div>
{_summary(runs)}
{_missing(list(missing))}
{"".join(f'<p class="attestation">{_e(label)}: {_e(record_line(r[ATTESTATION]))}</p>' for label, r in runs
         if r.get(ATTESTATION))}
{maps}
<h2>Failing checks</h2>
{_failing(runs)}
<h2>Remedies</h2>
{_remedies(runs)}
{fleet.histories(runs)}
<h2>all_reduce bandwidth and time</h2>
{_sweeps(runs, list(references))}
<h2>Per-GPU and per-rank figures</h2>
{per_gpu}
<h2>Burn-in over time</h2>
{_burn(runs) if len(runs) <= FLEET_RUNS else '<p class="muted">A fleet: each report.json holds its burn-in series.</p>'}
<h2>Every check, per run</h2>
{_per_run(runs)}
<p class="muted">Made by stackproof {_e(__version__)} on {_e(created)} from report.json (docs/report-format.md).</p>
</body></html>
"""


def missing_reports(paths: list[Path]) -> list[Path]:
    """The folders among `paths` that hold no report.json: a fleet's node whose run wrote none (the others
    are drawn; these are listed). A path that is not there at all is a typo, for `load` to refuse."""
    return [path for path in paths if path.is_dir() and not report_file(path).exists()]


def write(paths: list[Path], output: Path, references: list[Path] = ()) -> tuple[Path, list[Path]]:
    """The page of the runs at `paths`, written to `output`; (output, the folders that held no report)."""
    missing = missing_reports(paths)
    if len(missing) == len(paths):
        raise ConfigError(f"{', '.join(map(str, paths))}: expected reports folders holding a {REPORT_FILE}, found "
                          f"none that does; fix: name the folders validate wrote (its --reports)")
    runs = [load(path) for path in paths if path not in missing]
    text = render(runs, [(path.name, nccl_tests.read(path)) for path in references], missing)
    files.write_text(output, text)  # into a folder that exists (outputs.output_file): none is made
    return output, missing
