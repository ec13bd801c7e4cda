"""The decision: what is done to each node of a run, from the run record's findings (report/record.py).

Every finding names its node: the rank that made it stamped it, or the launcher did (a GPU lost at pre-flight,
GPUs missing, a hang pinned on one GPU). A node's action is the strongest the policy table (policy.py) gives over
its own findings, and its reason leads with the finding that decided it. A node without findings passes, whatever
other nodes found. Outcomes without a finding act on nothing, because they say nothing about a machine: bad input
(2), an interruption (5), a run that did not complete and names nobody (a rank that died, --run-timeout). Nor is
a record acted on that is older than the run that asked, says another exit code than the run returned, or comes
from a run with --inject-fault (a demonstration, not a fault of the machine).
"""

from __future__ import annotations

import dataclasses

from stackproof.errors import Exit
from stackproof.judge import policy
from stackproof.judge.findings import Finding
from stackproof.report.record import Report

PASS = "pass"
PREFIX = "stackproof:"
# Slurm documents no limit on a node's reason, but `sinfo -R` and `scontrol show node` print it on one line:
# keep it readable there. Kubernetes label values are at most 63 characters (the verdict label is pass/fail).
REASON_MAX = 120
NOT_ACTED_ON = (Exit.USAGE, Exit.INTERRUPTED)  # these outcomes say nothing about the machine


@dataclasses.dataclass(frozen=True)
class NodeAction:
    node: str
    action: str  # PASS, or policy.DRAIN / ALERT / REPORT
    reason: str = ""  # "stackproof: <check> <where> (+N more)", within REASON_MAX
    findings: tuple[Finding, ...] = ()  # strongest first
    held: str = ""  # why a drain the policy asked for was not done (the circuit breaker, --max-nodes)

    @property
    def failed(self) -> bool:
        return self.action != PASS

    @property
    def drain(self) -> bool:
        return self.action == policy.DRAIN

    @property
    def checks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.source or f.check for f in self.findings))

    def words(self) -> str:
        held = f" (drain withheld: {self.held})" if self.held else ""
        return f"{self.node}: {self.action}{held}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Decision:
    exit_code: Exit
    message: str  # the run's own one-sentence why (the record's message)
    actions: tuple[NodeAction, ...] = ()
    withheld: str = ""  # why nothing is acted on, when the run's outcome acts on nothing

    @property
    def to_act(self) -> tuple[NodeAction, ...]:
        return tuple(a for a in self.actions if a.failed)

    @property
    def drains(self) -> tuple[NodeAction, ...]:
        return tuple(a for a in self.actions if a.drain)

    def hold_drains(self, why: str, nodes: set[str] | None = None) -> Decision:
        """The same decision with its drains (of `nodes`, default all) turned into alerts that say why."""
        held = tuple(dataclasses.replace(a, action=policy.ALERT, held=why)
                     if a.drain and (nodes is None or a.node in nodes) else a for a in self.actions)
        return dataclasses.replace(self, actions=held)

    def summary(self) -> str:
        if self.withheld:
            return f"not acted on: {self.withheld}"
        if not self.to_act:
            return "every node passed: nothing to act on"
        by_action = {name: [a.node for a in self.to_act if a.action == name] for name in policy.ACTIONS}
        return "; ".join(f"{name}: {', '.join(nodes)}" for name, nodes in by_action.items() if nodes)


def decide(record: Report, *, exit_code: int | None = None, not_before: float | None = None,
           max_nodes: int | None = None, node: str | None = None) -> Decision:
    """`exit_code`: what the run that just ended returned, when the caller saw it (healthcheck); `not_before`: when
    that run started (epoch seconds), so that a record left by an earlier run is never acted on; `node`: the node
    the run was on, for findings that name none."""
    code, message = record.exit_code, record.message
    if exit_code is not None and int(code) != exit_code:
        return Decision(_exit(exit_code), message, withheld=f"the run exited {exit_code} but its record says "
                                                             f"{int(code)} (a record of another run?)")
    if not_before is not None and record.started < not_before - 1:
        return Decision(code, message, withheld="the record was started before this run: a stale report")
    if record.settings.get("inject_fault"):
        return Decision(code, message, withheld=f"the run injected a fault on purpose (--inject-fault "
                                                f"{record.settings['inject_fault']}): a demonstration, not a fault "
                                                "of the machine")
    names = list(dict.fromkeys(r["node"] for r in record.ranks))
    if code == Exit.OK:
        return Decision(code, message, actions=tuple(NodeAction(n, PASS) for n in names))
    if code in NOT_ACTED_ON:
        return Decision(code, message, withheld=f"exit code {int(code)} ({code.meaning}) says nothing about the "
                                                "machine")
    by_node = by_node_of(record.all_findings(), names, node)
    if not by_node:
        return Decision(code, message, withheld=f"exit code {int(code)} ({code.meaning}) with no finding that "
                                                "names a machine at fault (fix: see the report's failed checks)")
    actions = tuple(node_action(n, by_node.get(n, [])) for n in dict.fromkeys([*names, *by_node]))
    decision = Decision(code, message, actions=actions)
    if max_nodes is not None and len(decision.drains) > max_nodes:
        drained = [a.node for a in decision.drains]
        return decision.hold_drains(f"{len(drained)} nodes to drain ({', '.join(drained)}), more than --max-nodes "
                                    f"{max_nodes}: a failure that wide is more likely the image or the settings")
    return decision


def by_node_of(findings: list[Finding], names: list[str], node: str | None) -> dict[str, list[Finding]]:
    """The findings of each node. One that names no node is the run's only node's, or `node`'s (the node this
    command runs on); with several nodes and none given, it stays unplaced and acts on nothing."""
    fallback = node or (names[0] if len(names) == 1 else None)
    grouped: dict[str, dict[tuple, Finding]] = {}
    for finding in findings:
        where = finding.node or fallback
        if where:  # the same finding from several ranks of the node (each reads the node's GPUs) counts once
            same = (finding.gpu_index, finding.check, finding.found, finding.category)
            kept = grouped.setdefault(where, {})
            if same not in kept or (finding.pci_bus_id and not kept[same].pci_bus_id):
                kept[same] = finding
    return {where: list(found.values()) for where, found in grouped.items()}


def node_action(node: str, findings: list[Finding]) -> NodeAction:
    if not findings:
        return NodeAction(node, PASS)
    ranked = policy.strongest_first(findings)
    first = ranked[0]
    where = first.where()
    more = f" (+{len(ranked) - 1} more)" if len(ranked) > 1 else ""
    what = first.source or first.check
    reason = fit(f"{PREFIX} {what}{'' if where == 'node' else ' ' + where}{more}")
    return NodeAction(node, policy.of(first), reason, tuple(ranked))


def _exit(value: int) -> Exit:
    try:
        return Exit(value)
    except ValueError:
        return Exit.INCOMPLETE


def fit(reason: str, limit: int = REASON_MAX) -> str:
    """One line, within `limit` characters (cut with '...'); no '|' (the breaker's sinfo output separator)."""
    line = " ".join(reason.replace("|", "/").split())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."
