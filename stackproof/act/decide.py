"""The decision: which nodes of a run are drained, alerted on or only reported, with the reason a person reads.

Each failed check on a node maps through the policy table (policy.py) by its category and severity; the node
gets the strongest action among its failed checks. A failure no check classified alerts, never drains. Other
outcomes act on nothing, because they say nothing about the machine, except where the machine is proven at fault:
  - 2 bad input: stackproof's own flags, settings, matrix or lock were wrong; nothing ran.
  - 3 no GPU visible: drained (policy.GPUS_MISSING) when the scheduler allocated GPUs on the node
    (SLURM_GPUS_ON_NODE) or its PCI bus shows NVIDIA GPUs (healthcheck reads it); otherwise a launch that gave
    the container no GPU looks the same as a dead driver, so nothing acts.
  - 4 the run did not complete: drained (policy.GPU_HANG) when the watchdog pinned the stall on one rank that
    drives a GPU; a rank that died, --run-timeout, or a stall of several ranks names no machine.
  - 5 interrupted: the run was stopped (Ctrl-C, SIGTERM, scancel) before every check ran.
A report that cannot be read, is of another schema, or is older than the run that asked (a stale file left in
the folder) acts on nothing either.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stackproof.act import policy
from stackproof.errors import ConfigError, Exit
from stackproof.report.record import REPORT_FILE, SCHEMA

PASS = "pass"
PREFIX = "stackproof:"
# Slurm documents no limit on a node's reason, but `sinfo -R` and `scontrol show node` print it on one line:
# keep it readable there. Kubernetes label values are at most 63 characters (the verdict label is pass/fail).
REASON_MAX = 120
# report.json's context["reason"] for GPUs the scheduler allocated (run/visibility.py's expected_gpus).
SCHEDULER_GPUS = "SLURM_GPUS_ON_NODE="


@dataclasses.dataclass(frozen=True)
class NodeAction:
    node: str
    action: str  # PASS, or policy.DRAIN / ALERT / REPORT
    reason: str = ""  # "stackproof: <check> <gpu>", within REASON_MAX
    checks: tuple[str, ...] = ()
    held: str = ""  # why a drain the policy asked for was not done (the circuit breaker, --max-nodes)

    @property
    def failed(self) -> bool:
        return self.action != PASS

    @property
    def drain(self) -> bool:
        return self.action == policy.DRAIN

    def words(self) -> str:
        held = f" (drain withheld: {self.held})" if self.held else ""
        return f"{self.node}: {self.action}{held}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Decision:
    exit_code: Exit
    message: str  # the run's own one-sentence why (report.json's `message`)
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


def load(reports_dir: Path) -> dict[str, Any]:
    path = reports_dir / REPORT_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: expected a finished run's report, found no file; fix: point --reports at the "
                          "folder `stackproof validate --reports DIR` wrote") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: expected report.json ({SCHEMA}), could not read it ({err}); fix: re-run the "
                          "validation") from None


def decide(report: dict[str, Any], *, exit_code: int | None = None, not_before: str | None = None,
           max_nodes: int | None = None, node: str | None = None, gpus_on_pci: int = 0) -> Decision:
    """`exit_code`: what the run that just ended returned, when the caller saw it (healthcheck); `not_before`: the
    ISO time that run started, so that a report left by an earlier run is never acted on; `node`: the node the
    run was on, for outcomes whose report names none (exit 3); `gpus_on_pci`: NVIDIA GPUs its PCI bus shows."""
    code = _exit(report.get("exit_code"))
    message = str(report.get("message", ""))
    if report.get("schema") != SCHEMA:
        return Decision(code or Exit.USAGE, message, withheld=f"report schema {report.get('schema')!r}, expected "
                                                                f"{SCHEMA!r}: this stackproof cannot read it")
    if exit_code is not None and code != exit_code:
        return Decision(_exit(exit_code) or Exit.USAGE, message,
                        withheld=f"the run exited {exit_code} but its report.json says {report.get('exit_code')} "
                                 f"(a report of another run?)")
    if not_before and str(report.get("started", "")) < not_before:
        return Decision(code or Exit.USAGE, message, withheld=f"report.json was started at {report.get('started')}, "
                                                              f"before this run ({not_before}): a stale report")
    nodes = report.get("nodes") or ([{"node": node, "ranks": [], "failed_checks": []}] if node else [])
    if code == Exit.OK:
        return Decision(code, message, actions=tuple(NodeAction(n["node"], PASS) for n in nodes))
    if code == Exit.NO_GPU:
        return _no_gpu(report, message, node, gpus_on_pci)
    if code == Exit.INCOMPLETE:
        nodes = _hang_pinned(report, nodes)
    elif code == Exit.FAILED and not any(n.get("verdict") == "FAIL" for n in nodes) and len(nodes) == 1:
        # One node, and a failed check that names no rank: the check was about this node as a whole.
        nodes = [{**nodes[0], "verdict": "FAIL", "failed_checks": [
            {"check": c["name"], "ranks": [], "category": c.get("category", ""), "severity": c.get("severity", "")}
            for c in report.get("checks", []) if c.get("outcome") == "failed"]}]
    if code not in (Exit.FAILED, Exit.INCOMPLETE) or not any(n.get("verdict") == "FAIL" for n in nodes):
        meaning = code.meaning if code is not None else "unknown"
        why = ("a check failed, but it names no node (fix: see the report's failed checks)" if code == Exit.FAILED
               else f"exit code {report.get('exit_code')} ({meaning}) names no machine at fault")
        return Decision(code or Exit.USAGE, message, withheld=why)
    decision = Decision(code, message, actions=tuple(_action(n, report.get("ranks", [])) for n in nodes))
    if max_nodes is not None and len(decision.drains) > max_nodes:
        drained = [a.node for a in decision.drains]
        return decision.hold_drains(f"{len(drained)} nodes to drain ({', '.join(drained)}), more than --max-nodes "
                                    f"{max_nodes}: a failure that wide is more likely the image or the settings")
    return decision


def _exit(value: Any) -> Exit | None:
    try:
        return Exit(int(value))
    except (TypeError, ValueError):
        return None


def _no_gpu(report: dict[str, Any], message: str, node: str | None, gpus_on_pci: int) -> Decision:
    context = report.get("context", {})
    why = str(context.get("reason", ""))
    if why.startswith(SCHEDULER_GPUS):
        evidence = f"no GPU visible, {why.split(' ')[0]}"
    elif gpus_on_pci > 0:
        evidence = f"no GPU visible, {gpus_on_pci} NVIDIA GPU(s) on the PCI bus"
    else:
        return Decision(Exit.NO_GPU, message, withheld=f"exit code 3 ({Exit.NO_GPU.meaning}) with GPUs expected "
                                                       f"from {why or 'the settings'}, not from the scheduler or "
                                                       "the PCI bus: the launch, not the node, may be at fault")
    if not node:
        return Decision(Exit.NO_GPU, message, withheld=f"{evidence}, but the report names no node (fix: --node)")
    category, severity = policy.GPUS_MISSING
    return Decision(Exit.NO_GPU, message, actions=(
        NodeAction(node, policy.action(category, severity), fit(f"{PREFIX} {evidence}"), ("gpus-missing",)),))


def _hang_pinned(report: dict[str, Any], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Exit 4: the check the watchdog stopped (its message is the run's) is judged as a hang, whatever its own
    class: one stalled rank that drives a GPU is a GPU hang (hardware); any other stall names no machine. Checks
    that failed before it keep their class."""
    gpu_ranks = {r.get("rank") for r in report.get("ranks", []) if r.get("gpu")}
    stopped = {c["name"]: c.get("failed_ranks", []) for c in report.get("checks", [])
               if c.get("outcome") == "failed" and c.get("message") == report.get("message")}
    pinned = []
    for node in nodes:
        checks = []
        for failed in node.get("failed_checks", []):
            if failed["check"] in stopped:
                stalled = stopped[failed["check"]]  # over the whole run, not this node's share
                one_gpu = len(stalled) == 1 and stalled[0] in gpu_ranks
                category, severity = policy.GPU_HANG if one_gpu else ("", "")
                failed = {**failed, "category": category, "severity": severity}
            checks.append(failed)
        pinned.append({**node, "failed_checks": checks})
    return pinned


def _action(node: dict[str, Any], ranks: list[dict[str, Any]]) -> NodeAction:
    failed = node.get("failed_checks", [])
    if node.get("verdict") != "FAIL":
        return NodeAction(node["node"], PASS)
    if not failed:
        return NodeAction(node["node"], policy.UNCLASSIFIED, fit(f"{PREFIX} a check failed"))
    actions = [policy.action(f.get("category", ""), f.get("severity", "")) for f in failed]
    strongest = policy.strongest(actions)
    first = failed[actions.index(strongest)]
    where = _gpu_words(first.get("ranks", []), ranks)
    more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
    return NodeAction(node["node"], strongest, fit(f"{PREFIX} {first['check']}{(' ' + where) if where else ''}{more}"),
                      tuple(f["check"] for f in failed))


def _gpu_words(failed_ranks: list[int], ranks: list[dict[str, Any]]) -> str:
    """'GPU 3 PCI 0000:19:00.0' for the first failing rank on a GPU, 'rank 6' on CPU ranks."""
    by_rank = {r.get("rank"): r for r in ranks}
    words = []
    for rank in failed_ranks[:2]:
        gpu = (by_rank.get(rank) or {}).get("gpu")
        if gpu:
            words.append(" ".join(x for x in (f"GPU {gpu.get('index')}",
                                              f"PCI {gpu['pci_bus_id']}" if gpu.get("pci_bus_id") else "") if x))
        else:
            words.append(f"rank {rank}")
    return ", ".join(words) + (f" +{len(failed_ranks) - 2}" if len(failed_ranks) > 2 else "")


def fit(reason: str, limit: int = REASON_MAX) -> str:
    """One line, within `limit` characters (cut with '...')."""
    line = " ".join(reason.split())
    return line if len(line) <= limit else line[:limit - 3].rstrip() + "..."
