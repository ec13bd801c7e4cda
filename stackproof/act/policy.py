"""The policy table, in one place: what a failed check does to its node, by its (category, severity)
(stackproof/judge/findings.py; docs/act.md prints this table).

  drain   take the node out of service: Slurm drains it, Kubernetes taints it (and labels it fail). Only the
          machine's own faults: its GPUs, its links, or a figure the check itself says warrants it.
  alert   the node stays in service; the run fails and says why loudly (a `stackproof ALERT:` line on stderr,
          Kubernetes labels the node fail with the reason): the image's, the settings' or the operator's
          fault, or a failure no check classified. Draining for these would empty a fleet one node at a time.
  report  the node stays in service; the run fails and the report says why (a person looks when they can).
"""

from __future__ import annotations

from stackproof.judge.findings import CATEGORIES, SEVERITIES, Finding

DRAIN, ALERT, REPORT = "drain", "alert", "report"
ACTIONS = (DRAIN, ALERT, REPORT)  # strongest first: a node with several failed checks gets the strongest

TABLE: dict[tuple[str, str], str] = {
    ("gpu-hardware", "isolate"): DRAIN,
    ("gpu-hardware", "reset"): DRAIN,
    ("gpu-hardware", "triage"): DRAIN,
    ("interconnect", "isolate"): DRAIN,
    ("interconnect", "reset"): DRAIN,
    ("interconnect", "triage"): ALERT,  # e.g. a slow pair no member of which was named
    ("performance", "isolate"): DRAIN,
    ("performance", "reset"): DRAIN,
    ("performance", "triage"): REPORT,  # below the bar, still working
    ("software-pins", "isolate"): ALERT,
    ("software-pins", "reset"): ALERT,
    ("software-pins", "triage"): ALERT,
    ("configuration", "isolate"): ALERT,
    ("configuration", "reset"): ALERT,
    ("configuration", "triage"): ALERT,
    # A failure that says nothing about the machine: loud, never a drain.
    ("unclassified", "isolate"): ALERT,
    ("unclassified", "reset"): ALERT,
    ("unclassified", "triage"): ALERT,
    ("tool-error", "isolate"): ALERT,
    ("tool-error", "reset"): ALERT,
    ("tool-error", "triage"): ALERT,
}
UNCLASSIFIED = ALERT  # a check that did not say what its failure means never drains



def action(category: str, severity: str) -> str:
    """What a failure of this (category, severity) does to its node; unclassified ('', '') -> UNCLASSIFIED."""
    return TABLE.get((category, severity), UNCLASSIFIED)


def strongest(actions: list[str]) -> str:
    return min(actions, key=ACTIONS.index)


def of(finding: Finding) -> str:
    return action(finding.category, finding.severity)


def strongest_first(findings: list[Finding]) -> list[Finding]:
    """The findings ordered by what the policy does with them (drain first), then by severity: the first one
    decides the node's action and leads its reason."""
    return sorted(findings, key=lambda f: (ACTIONS.index(of(f)), SEVERITIES.index(f.severity)))


def markdown() -> str:
    """The table as docs/act.md prints it (a test keeps the two the same)."""
    lines = ["| category | " + " | ".join(SEVERITIES) + " |", "|---|" + "---|" * len(SEVERITIES)]
    lines += [f"| {c} | " + " | ".join(TABLE[(c, s)] for s in SEVERITIES) + " |" for c in CATEGORIES]
    return "\n".join(lines)
