"""stackproof.prom: a run's verdict as node_exporter textfile-collector metrics (docs/report-format.md), for the
alert rules and the dashboard in deploy/prometheus/.

Names follow Prometheus' conventions: a `stackproof_` prefix, base units in the name (`_seconds`,
`_timestamp_seconds`), gauges only. Labels: `node` (the scheduler's name), `gpu` (the NVML index, as
dcgm-exporter's `gpu`), `uuid`, `rank`, `check`, `category`, `severity`; a label with no value is left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stackproof.errors import Exit

if TYPE_CHECKING:
    from stackproof.report.record import Report

# name -> HELP. The alert rules and the dashboard use these names (tests/test_prometheus.py holds them to it).
RUN_EXIT_CODE = "stackproof_run_exit_code"
RUN_FINAL = "stackproof_run_final"
RUN_START = "stackproof_run_start_timestamp_seconds"
RUN_DURATION = "stackproof_run_duration_seconds"
NODE_PASSED = "stackproof_node_passed"
NODE_VALIDATED = "stackproof_node_validated_timestamp_seconds"
CHECK_PASSED = "stackproof_check_passed"
FINDING = "stackproof_finding"
CHECK_FIX = "stackproof_check_fix_info"
FIGURE = "stackproof_figure"
FINDING_REMEDY = "stackproof_finding_remedy_info"
HELP = {
    RUN_EXIT_CODE: "stackproof validate's exit code (0 every check passed, 1 a check failed, 4 not complete; "
                   "docs/report-format.md); 4 while the run is still going",
    RUN_FINAL: "1 once the verdict is final (rank 0 finished, or the launcher said what stopped the run), 0 while "
               "the run is going",
    RUN_START: "when rank 0 started the run (Unix time)",
    RUN_DURATION: "seconds from rank 0's start to its verdict",
    NODE_PASSED: "1 if every check that ran on the node passed in a run that ran every check, 0 if not; absent "
                 "while the run is going",
    NODE_VALIDATED: "when the run that checked this node started (Unix time)",
    CHECK_PASSED: "1 if the check passed on the node, 0 if it failed; skipped checks are absent",
    FINDING: "1 per finding: the node, GPU and check to act on, with its category and severity",
    CHECK_FIX: "1 per failed check; the label fix is what to do about it",
    FIGURE: "a measured figure of a check, per rank (and GPU); the unit is a label",
    FINDING_REMEDY: "1 per finding: its remedy (act/policy.py), first_step the cheapest, steps every step in "
                    "order (the next when one does not clear it)",
}


def textfile(report: Report) -> str:
    """The metrics of one report, each family's samples together (the text format requires it)."""
    samples: dict[str, list[str]] = {name: [] for name in HELP}

    def add(name: str, value: float, **labels: Any) -> None:
        samples[name].append(f"{name}{_labels(labels)} {_number(value)}")

    code = report.exit_code
    final = report.complete or report.override is not None
    add(RUN_EXIT_CODE, int(code))
    add(RUN_FINAL, int(final))
    add(RUN_START, round(report.started, 3))
    if report.wall_time_s is not None:
        add(RUN_DURATION, round(report.wall_time_s, 3))

    nodes = report.nodes()
    every_check_ran = code in (Exit.OK, Exit.FAILED)
    for node in nodes:
        add(NODE_VALIDATED, round(report.started, 3), node=node["node"])
        if final:
            add(NODE_PASSED, int(every_check_ran and node["verdict"] == "PASS"), node=node["node"])

    ident = {int(i["rank"]): i for i in report.ranks}
    failed_nodes = {f["check"]: set() for node in nodes for f in node["failed_checks"]}
    for node in nodes:
        for failed in node["failed_checks"]:
            failed_nodes[failed["check"]].add(node["node"])
    for check in report.checks:
        if check.outcome == "skipped":
            continue
        for node in nodes or [{"node": ""}]:
            # A failure no rank was named for (rank 0's own judgement of the whole run), or a report that does
            # not say where the ranks ran, fails every node.
            failed = check.outcome == "failed" and (not nodes or not check.failed_ranks or node["node"] in
                                                    failed_nodes.get(check.name, ()))
            add(CHECK_PASSED, int(not failed), node=node["node"], check=check.name)
        if check.outcome != "failed":
            continue
        if check.hint:
            add(CHECK_FIX, 1, check=check.name, fix=check.hint)
    for finding in report.all_findings():
        node = finding.node or (ident.get(finding.rank) or {}).get("node", "")
        add(FINDING, 1, node=node, gpu="" if finding.gpu_index is None else finding.gpu_index,
            uuid="" if finding.uuid == "n/a" else finding.uuid, rank="" if finding.rank is None else finding.rank,
            check=finding.source or finding.check, category=finding.category, severity=finding.severity)
    for entry in report.remedies():
        node = entry["node"] or (ident.get(entry["rank"]) or {}).get("node", "")
        steps = [s["step"] for s in entry["steps"]]
        add(FINDING_REMEDY, 1, node=node, gpu="" if entry["gpu_index"] is None else entry["gpu_index"],
            rank="" if entry["rank"] is None else entry["rank"], check=entry["check"], first_step=steps[0],
            steps=">".join(steps))

    rank_at = {(i.get("host"), (i.get("gpu") or {}).get("index")): rank for rank, i in ident.items()}
    for check in report.checks:
        own = {0: check.figures, **check.rank_figures}
        for rank, figures in own.items():
            for name, figure in figures.items():
                if not isinstance(figure.value, (int, float)) or isinstance(figure.value, bool):
                    continue
                # Rank 0 records every GPU's figure as name@host:gpu: it is the figure of the rank on that GPU,
                # unless that rank reported the figure itself.
                base, _, at = name.partition("@")
                host, _, index = at.rpartition(":")
                of = rank_at.get((host, int(index))) if index.isdigit() else None
                if of is None:
                    of, base = rank, name
                elif base in own.get(of, {}):
                    continue
                add(FIGURE, figure.value, **_where(ident.get(of, {})), rank=of, check=check.name, figure=base,
                    unit=figure.unit)

    lines = []
    for name, help_text in HELP.items():
        if samples[name]:  # a family with no samples is left out, HELP and TYPE too
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples[name]]
    return "\n".join(lines) + "\n"


def _where(ident: dict[str, Any]) -> dict[str, Any]:
    gpu = ident.get("gpu") or {}
    return {"node": ident.get("node", ""), "gpu": gpu.get("index", ""), "uuid": gpu.get("uuid", "")}


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _labels(labels: dict[str, Any]) -> str:
    def escape(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    shown = [f'{key}="{escape(value)}"' for key, value in labels.items() if value not in ("", None)]
    return "{" + ",".join(shown) + "}" if shown else ""
