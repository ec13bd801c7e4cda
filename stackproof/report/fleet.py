"""The fleet at a glance: a node x check map and a node x GPU map per figure, as HTML tables coloured by CSS (one
cell per node and check, or per node and GPU), with the failing cells named under each map. Tables, not plots:
1024 GPUs draw in milliseconds, stay sharp at any zoom, and each cell says what it is (its title)."""

from __future__ import annotations

import html
import re
import statistics
from collections.abc import Sequence
from typing import Any

from stackproof.judge import baseline

HISTORY = "_node_history"  # the page's own key for the node history a healthcheck left beside its report.json
HISTORY_FILE = "node-history.json"  # act/history.py's RUN_COPY (tests/test_fleet_page.py holds them equal)
HISTORY_SCHEMA = "stackproof.history/1"

STYLE = """
.map { border-collapse: collapse; font-size: 0.72em; }
.map th, .map td { border: 1px solid #fff; padding: 0; }
.map td { width: 1.1em; height: 1.1em; text-align: center; line-height: 1.1em; }
.map th.node { text-align: right; padding-right: 0.4em; font-weight: normal; white-space: nowrap; background: none; }
.map th.col { writing-mode: vertical-rl; transform: rotate(180deg); white-space: nowrap; font-weight: normal;
  padding: 0.2em 0; background: none; }
.map th.col.failing { color: #c62828; font-weight: bold; }
.map td.PASS { background: #66bb6a; } .map td.FAIL { background: #c62828; color: #fff; font-weight: bold; }
.map td.SKIP { background: #cfd8dc; } .map td.NONE { background: #f5f5f5; }
.gpumap td { width: 3.4em; padding: 0 0.2em; font-variant-numeric: tabular-nums; text-align: right; }
.gpumap td.below { outline: 2px solid #000; outline-offset: -2px; font-weight: bold; }
.legend span { display: inline-block; width: 1em; height: 1em; vertical-align: middle; margin: 0 0.3em 0 0.8em; }
.failing-cells { columns: 2; font-size: 0.85em; }
.gpumaps { display: flex; flex-wrap: wrap; gap: 0 2em; align-items: flex-start; }
.gpufig { width: min-content; min-width: 24em; max-width: 100%; }
.gpufig .failing-cells { columns: 1; }
.gpufig h3 { font-size: 0.95em; }
.history td.out { color: #c62828; font-weight: bold; } .history td.back { color: #2e7d32; }
.history ol { margin: 0; padding-left: 1.2em; }
"""
# A figure this much worse than the fleet's median is drawn fully red; better than the median, fully green.
RED_AT = 0.20


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _natural(text: str) -> list[Any]:
    """gpu-2 before gpu-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _rows(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(row label, node, report) per node of every run; a node seen in several runs is labelled with the run."""
    seen: dict[str, int] = {}
    for _, report in runs:
        for node in report.get("nodes", []):
            seen[node.get("node", "?")] = seen.get(node.get("node", "?"), 0) + 1
    rows = []
    for label, report in runs:
        for node in report.get("nodes", []):
            name = node.get("node", "?")
            rows.append((f"{name} ({label})" if seen[name] > 1 else name, name, report))
    return sorted(rows, key=lambda row: _natural(row[0]))


def _where(report: dict[str, Any], rank: int) -> str:
    ranks = report.get("ranks", [])
    ident = ranks[rank] if 0 <= rank < len(ranks) else {}
    gpu = ident.get("gpu") or {}
    return f"rank {rank} GPU {gpu['index']} {gpu.get('uuid', '')}".strip() if gpu else f"rank {rank}"


def check_map(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """node x check: PASS, FAIL, SKIP or not run, the failing cells listed by node with their ranks and GPUs."""
    rows = _rows(runs)
    if not rows:
        return '<p class="muted">No report names a node (no rank started), so there is no node x check map.</p>'
    columns: list[str] = []
    for _, report in runs:
        for check in report.get("checks", []):
            if check.get("name") not in columns:
                columns.append(check.get("name"))
    if not columns:
        return '<p class="muted">No check ran on any node.</p>'
    failing_columns, named, body = set(), [], []
    for label, node_name, report in rows:
        node = next(n for n in report.get("nodes", []) if n.get("node") == node_name)
        failed_here = {f["check"]: f.get("ranks", []) for f in node.get("failed_checks", [])}
        checks = {c.get("name"): c for c in report.get("checks", [])}
        cells = []
        for name in columns:
            check = checks.get(name)
            verdict = check.get("verdict", "?") if check else "NONE"
            if verdict == "FAIL" and check.get("failed_ranks") and name not in failed_here:
                verdict = "PASS"  # it failed on other nodes
            if verdict == "FAIL":
                failing_columns.add(name)
                ranks = failed_here.get(name) or check.get("failed_ranks") or []
                where = "; ".join(_where(report, r) for r in ranks[:8]) or "the run as a whole"
                named.append(f"<li><b>{_e(label)}</b> &times; {_e(name)}: {_e(where)}</li>")
                cells.append(f'<td class="FAIL" title="{_e(label)} x {_e(name)}: FAIL ({_e(where)})">&#x2717;</td>')
            else:
                cells.append(f'<td class="{_e(verdict)}" title="{_e(label)} x {_e(name)}: '
                             f'{_e(verdict if verdict != "NONE" else "not run")}"></td>')
        body.append(f'<tr><th class="node">{_e(label)}</th>{"".join(cells)}</tr>')
    head = "".join(f'<th class="col{" failing" if c in failing_columns else ""}" title="{_e(c)}">{_e(c)}</th>'
                   for c in columns)
    legend = (f'<p class="legend">{len(rows)} nodes &times; {len(columns)} checks:'
              '<span style="background:#66bb6a"></span>pass<span style="background:#c62828"></span>fail'
              '<span style="background:#cfd8dc"></span>skipped<span style="background:#f5f5f5"></span>not run</p>')
    failing = (f'<h3>Failing cells ({len(named)})</h3><ul class="failing-cells">{"".join(named)}</ul>' if named
               else "<p>No cell failed.</p>")
    # The failing cells first: at 128 nodes the map is taller than a screen.
    return (f'{failing}{legend}<div class="wide"><table class="map" id="node-check-map"><thead><tr><th></th>{head}'
            f'</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def _per_gpu_figures(report: dict[str, Any]) -> dict[tuple[str, str], dict[tuple[str, int], tuple[float, str]]]:
    """(check, figure) -> (node, GPU index or local rank) -> (value, unit), for the figures measured per GPU (the
    per_gpu checks') or that differ between ranks."""
    per_rank = baseline.per_rank_figures(report)
    ranks = {int(r.get("rank", i)): r for i, r in enumerate(report.get("ranks", []))}
    out: dict[tuple[str, str], dict[tuple[str, int], tuple[float, str]]] = {}
    for rank, checks in per_rank.items():
        ident = ranks.get(rank, {})
        gpu = ident.get("gpu") or {}
        column = gpu.get("index", ident.get("local_rank", rank))
        for check, figures in checks.items():
            for name, figure in figures.items():
                out.setdefault((check, name), {})[(ident.get("node", "?"), column)] = (figure["value"],
                                                                                        figure["unit"])
    return {key: cells for key, cells in out.items()
            if key[0].startswith("per_gpu::") or len({v for v, _ in cells.values()}) > 1}


def _colour(value: float, median: float, better: str) -> str:
    worse = (median - value) / median if better == "higher" else (value - median) / median
    hue = 120 * min(1.0, max(0.0, 1 - worse / RED_AT)) if median else 60
    return f"hsl({hue:.0f}, 60%, 62%)"


def gpu_maps(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One node x GPU table per figure measured per GPU, coloured by how far each GPU is from the fleet's median,
    the GPUs below the check's bar outlined and named."""
    figures: dict[tuple[str, str], dict[str, Any]] = {}
    for label, report in runs:
        bars = {c.get("name"): c.get("figures", {}) for c in report.get("checks", [])}
        for key, cells in _per_gpu_figures(report).items():
            entry = figures.setdefault(key, {"cells": {}, "bar": None})
            for (node, column), value in cells.items():
                entry["cells"][(node, column, label)] = value
            bar = (bars.get(key[0], {}).get(f"{key[1]}_bar") or {}).get("value")
            if isinstance(bar, (int, float)):
                entry["bar"] = bar
    if not figures:
        return '<p class="muted">No figure was measured per GPU or per rank in these reports.</p>'
    gpu_runs = any(r.get("gpu") for _, report in runs for r in report.get("ranks", []))
    out = []
    for (check, name), entry in sorted(figures.items()):
        cells, bar = entry["cells"], entry["bar"]
        unit = next(iter(cells.values()))[1]
        better = baseline.UNIT_BETTER.get(unit, "higher")
        median = statistics.median(v for v, _ in cells.values())
        nodes = sorted({(node, label) for node, _, label in cells}, key=lambda nl: _natural(nl[0] + nl[1]))
        repeated = {node for node, _ in nodes if sum(n == node for n, _ in nodes) > 1}
        columns = sorted({column for _, column, _ in cells})
        below, body = [], []
        for node, label in nodes:
            row_label = f"{node} ({label})" if node in repeated else node
            tds = []
            for column in columns:
                value = cells.get((node, column, label))
                if value is None:
                    tds.append('<td class="NONE"></td>')
                    continue
                fails = bar is not None and baseline.worse(value[0], bar, better, 0.0)
                title = f"{row_label} {'GPU' if gpu_runs else 'rank'} {column}: {name} {value[0]:.4g} {unit}"
                if fails:
                    below.append(f"<li><b>{_e(row_label)}</b> {'GPU' if gpu_runs else 'rank'} {_e(column)}: "
                                 f"{_e(f'{value[0]:.4g}')} {_e(unit)} (bar {_e(f'{bar:g}')})</li>")
                tds.append(f'<td class="{"below" if fails else ""}" style="background:'
                           f'{_colour(value[0], median, better)}" title="{_e(title)}">{value[0]:.3g}</td>')
            body.append(f'<tr><th class="node">{_e(row_label)}</th>{"".join(tds)}</tr>')
        head = "".join(f"<th>{'GPU' if gpu_runs else 'rank'} {_e(c)}</th>" for c in columns)
        bar_text = f", bar {bar:g} {unit} (outlined: below it)" if bar is not None else ""
        named = (f'<ul class="failing-cells">{"".join(below)}</ul>' if below else "")
        out.append(f'<div class="gpufig"><h3>{_e(check)} {_e(name)} ({_e(unit)}, {better} is better)</h3>{named}'
                   f'<p class="legend">{len(nodes)} nodes: green at or better than the median {median:.4g} {_e(unit)},'
                   f' red {RED_AT:.0%} or more worse{_e(bar_text)}</p>'
                   f'<div class="wide"><table class="map gpumap"><thead><tr><th></th>{head}</tr></thead>'
                   f'<tbody>{"".join(body)}</tbody></table></div></div>')
    return f'<div class="gpumaps">{"".join(out)}</div>'


def read_history(folder: Any) -> dict[str, Any] | None:
    """The node history beside a report.json (HISTORY_FILE), or None: none there, or not of its schema (the page
    says nothing of a file it cannot read rather than guess)."""
    import json
    from pathlib import Path

    try:
        data = json.loads((Path(folder) / HISTORY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == HISTORY_SCHEMA else None


def _when(at: Any) -> str:
    import datetime

    try:
        return datetime.datetime.fromtimestamp(float(at), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError, OverflowError):
        return "?"


def histories(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Each node's history with stackproof (taken out, remedy, re-proof, returned, held), the newest copy per node
    (a healthcheck writes its node's history into each run): where it stands now, then its events, newest first."""
    newest: dict[str, dict[str, Any]] = {}
    for _, report in runs:
        doc = report.get(HISTORY)
        if not doc:
            continue
        node = str(doc.get("node", "?"))
        events = doc.get("events") or []
        last = max((e.get("at", 0) for e in events), default=0)
        if node not in newest or last >= max((e.get("at", 0) for e in newest[node].get("events") or []), default=0):
            newest[node] = doc
    if not newest:
        return ""
    rows = []
    for node in sorted(newest, key=_natural):
        doc = newest[node]
        if doc.get("needs_service"):
            standing, cls = f"out: needs service ({doc['needs_service']})", "out"
        elif doc.get("out_of_service"):
            standing, cls = "out of service by stackproof", "out"
        else:
            standing, cls = "in service", "back"
        items = []
        for event in reversed(doc.get("events") or []):
            remedy = " -> ".join(event.get("remedy") or [])
            items.append(f"<li>{_e(_when(event.get('at')))} <b>{_e(event.get('event'))}</b>"
                         f"{' run ' + _e(event['run']) if event.get('run') else ''}"
                         f"{': ' + _e(event['reason']) if event.get('reason') else ''}"
                         f"{' (remedy: ' + _e(remedy) + ')' if remedy else ''}</li>")
        outs = sum(1 for e in doc.get("events") or [] if e.get("event") == "taken-out")
        rows.append(f'<tr><th class="node">{_e(node)}</th><td class="{cls}">{_e(standing)}</td><td>{outs}</td>'
                    f'<td><ol reversed>{"".join(items)}</ol></td></tr>')
    rule = next(iter(newest.values())).get("lemon_rule") or {}
    window = f"{float(rule.get('window_s', 0)) / 86400:g} days" if rule.get("window_s") else "the lemon window"
    return (f'<h2>Node history</h2><p class="legend">Taken out, remedy, re-proof, returned: a node taken out '
            f'{_e(rule.get("count", 2))} times within {_e(window)}, again after its return, stays out and needs '
            'service.</p><div class="wide"><table class="history"><thead><tr><th>node</th><th>now</th>'
            f'<th>taken out</th><th>events (newest first)</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
            '</div>')
