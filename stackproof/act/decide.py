"""The policy, in one place: which outcomes of a run act on a node, which nodes, and the reason a person reads.

Only a run that completed and found a check failing on a node acts (exit 1, Exit.FAILED). Every other outcome is
reported and acts on nothing, because it says nothing about the machine:
  - 2 bad input: stackproof's own flags, settings, matrix or lock were wrong; nothing ran.
  - 3 no GPU visible: from inside the tool a dead driver looks the same as a launch that gave the container no
    GPU (docker without --gpus, a wrong CUDA_VISIBLE_DEVICES, gres.conf); fewer GPUs than expected, but some,
    is a check failure (exit 1) and does act.
  - 4 the run did not complete: a rank died or timed out, or --run-timeout stopped the tool; which node is at
    fault is not proven.
  - 5 interrupted: the run was stopped (Ctrl-C, SIGTERM, scancel) before every check ran.
A report that cannot be read, is of another schema, or is older than the run that asked (a stale file left in
the folder) acts on nothing either.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stackproof.errors import ConfigError, Exit
from stackproof.suite.report import REPORT_FILE, SCHEMA

ACTS_ON = (Exit.FAILED,)
PREFIX = "stackproof:"
# Slurm documents no limit on a node's reason, but `sinfo -R` and `scontrol show node` print it on one line:
# keep it readable there. Kubernetes label values are at most 63 characters (the verdict label is pass/fail).
REASON_MAX = 120


@dataclasses.dataclass(frozen=True)
class NodeAction:
    node: str
    failed: bool  # True: drain / taint; False: the node passed (Kubernetes labels it pass)
    reason: str = ""  # "stackproof: <check> <gpu>", within REASON_MAX
    checks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    exit_code: Exit
    message: str  # the run's own one-sentence why (report.json's `message`)
    actions: tuple[NodeAction, ...] = ()
    withheld: str = ""  # why nothing is acted on, when the run's outcome acts on nothing

    @property
    def to_act(self) -> tuple[NodeAction, ...]:
        return tuple(a for a in self.actions if a.failed)

    def summary(self) -> str:
        if self.withheld:
            return f"not acted on: {self.withheld}"
        failed = [a.node for a in self.to_act]
        return f"failed node(s): {', '.join(failed)}" if failed else "every node passed: nothing to act on"


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
           max_nodes: int | None = None) -> Decision:
    """`exit_code`: what the run that just ended returned, when the caller saw it (healthcheck); `not_before`: the
    ISO time that run started, so that a report left by an earlier run is never acted on."""
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
    nodes = report.get("nodes") or []
    if code == Exit.OK:
        return Decision(code, message, actions=tuple(NodeAction(n["node"], False) for n in nodes))
    if code not in ACTS_ON:
        meaning = code.meaning if code is not None else "unknown"
        return Decision(code or Exit.USAGE, message,
                        withheld=f"exit code {report.get('exit_code')} ({meaning}) says nothing about the machine")
    if not any(n.get("verdict") == "FAIL" for n in nodes) and len(nodes) == 1:
        # One node, and a failed check that names no rank: the check was about this node as a whole.
        nodes = [{**nodes[0], "verdict": "FAIL", "failed_checks": [
            {"check": c["name"], "ranks": []} for c in report.get("checks", []) if c.get("outcome") == "failed"]}]
    actions = tuple(_action(node, report.get("ranks", [])) for node in nodes)
    failed = [a.node for a in actions if a.failed]
    if not failed:
        return Decision(code, message, withheld="a check failed, but it names no node (fix: see the report's "
                                                "failed checks)")
    if max_nodes is not None and len(failed) > max_nodes:
        return Decision(code, message, withheld=f"{len(failed)} nodes failed ({', '.join(failed)}), more than "
                                                f"--max-nodes {max_nodes}: a failure that wide is more likely the "
                                                "image or the settings")
    return Decision(code, message, actions=actions)


def _exit(value: Any) -> Exit | None:
    try:
        return Exit(int(value))
    except (TypeError, ValueError):
        return None


def _action(node: dict[str, Any], ranks: list[dict[str, Any]]) -> NodeAction:
    failed = node.get("verdict") == "FAIL"
    checks = tuple(f["check"] for f in node.get("failed_checks", []))
    if not failed:
        return NodeAction(node["node"], False)
    first = node["failed_checks"][0] if node.get("failed_checks") else {"check": "a check failed", "ranks": []}
    where = _gpu_words(first.get("ranks", []), ranks)
    more = f" (+{len(checks) - 1} more)" if len(checks) > 1 else ""
    return NodeAction(node["node"], True, fit(f"{PREFIX} {first['check']}{(' ' + where) if where else ''}{more}"),
                      checks)


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
