"""The run's record as the terminal shows it (docs/report-format.md): the check table, the node table (more than
one node), the remedies and the verdict. Every non-data line starts with '#' and the last line is the verdict, as
in nccl-tests. Functions that only read a Report."""

from __future__ import annotations

import time
from typing import Any

from stackproof.errors import Exit
from stackproof.report.record import Check, Report

HINT_WIDTH = 240  # the hint column is cut here: the whole message is in report.json
FIGURE_WIDTH = 60  # the figure column is no wider than this (longer figures run into the hint)
RANKS_SHOWN = 4  # failing ranks named in a row's hint; the rest counted


def table(report: Report) -> str:
    """The check table, the node table (more than one node), the remedies, the counts and the verdict."""
    rows = [(c.name, c.verdict, "; ".join(f"{k}={f.text()}" for k, f in c.figures.items()), note(report, c))
            for c in report.checks]
    width = max([len("check"), *(len(r[0]) for r in rows)])
    fig_width = min(FIGURE_WIDTH, max([len("figure"), *(len(r[2]) for r in rows)]))
    lines = [f"# {'check':<{width}}  verdict  {'figure':<{fig_width}}  hint"]
    lines += [f"  {name:<{width}}  {verdict:<7}  {figure:<{fig_width}}  {hint[:HINT_WIDTH]}".rstrip()
              for name, verdict, figure, hint in rows]
    nodes = report.nodes()
    if len(nodes) > 1:
        lines.append("#")
        lines += node_table(report, nodes)
    lines += remedy_lines(report)
    counts = report.counts()
    code = report.exit_code
    wall = report.wall_time_s if report.wall_time_s is not None else time.time() - report.started
    lines.append("#")
    lines.append(f"# Out of {len(report.planned) or len(report.checks)} checks: {counts['passed']} passed, "
                 f"{counts['failed']} failed, {counts['skipped']} skipped, {len(report.not_run())} not run; "
                 f"wall time {wall:.1f} s")
    left_out = report.left_out()
    if left_out:
        lines.append(f"# the selection left out {len(left_out)} check(s) this tier promises, not proven here: "
                     f"{', '.join(left_out)}")
    if code not in (Exit.OK, Exit.FAILED) or report.override:
        lines.append(f"# {report.message}")
    lines.append(f"# Verdict: {code.verdict} (exit code {int(code)}: {code.meaning})")
    return "\n".join(lines)


def node_table(report: Report, nodes: list[dict[str, Any]] | None = None) -> list[str]:
    """Per node: its verdict, ranks, GPUs and failed checks (with the ranks that failed them)."""
    nodes = nodes if nodes is not None else report.nodes()
    width = max(len("node"), *(len(n["node"]) for n in nodes))
    lines = [f"# {'node':<{width}}  verdict  ranks  {'gpus':<5}  failed checks"]
    for node in nodes:
        failed = "; ".join(f"{f['check']} (rank {', '.join(map(str, f['ranks']))})" for f in node["failed_checks"])
        lines.append(f"  {node['node']:<{width}}  {node['verdict']:<7}  {len(node['ranks']):>5}  "
                     f"{len(node['gpus']):<5}  {failed}".rstrip())
    return lines


def remedy_lines(report: Report) -> list[str]:
    """The remedies: one line per finding (the same finding from several ranks once), its steps cheapest first."""
    seen, lines = set(), []
    for entry in report.remedies():
        gpu = "" if entry["gpu_index"] is None else f"GPU {entry['gpu_index']}"
        where = " ".join(x for x in (entry["node"], gpu) if x) or "the run"
        line = f"#   {where}: {entry['check']} [{entry['category']}, {entry['severity']}]: " + \
            " -> ".join(s["step"] for s in entry["steps"])
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return ["#", "# remedy (cheapest step first; the next when it does not clear the finding):", *lines] \
        if lines else []


def note(report: Report, check: Check) -> str:
    """The table's last column: where it failed, why, and the fix; or why it was skipped. Where comes first: the
    column is cut at HINT_WIDTH, and a long message must not cut the rank, node and GPU off."""
    if check.outcome == "passed":
        return ""
    first = first_line(check.message)
    if check.outcome == "failed" and check.failed_ranks and report.ranks:
        shown = check.failed_ranks[:RANKS_SHOWN]
        first = "[" + "; ".join(report.where(r) for r in shown) + \
            (f"; +{len(check.failed_ranks) - RANKS_SHOWN} more" if len(check.failed_ranks) > RANKS_SHOWN else "") + \
            "] " + first
    if check.outcome == "failed" and check.hint:
        return f"{first} -- fix: {check.hint}"
    return first


def first_line(text: str) -> str:
    """A message's first line: the table's hint and junit's failure message."""
    return text.splitlines()[0] if text else ""
