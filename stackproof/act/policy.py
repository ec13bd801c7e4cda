"""The policy table, in one place: what a failed check does to its node, by its (category, severity)
(stackproof/judge/findings.py; docs/act.md prints this table).

  drain   take the node out of service: Slurm drains it, Kubernetes taints it (and labels it fail). Only the
          machine's own faults: its GPUs, its links, or a figure the check itself says warrants it.
  alert   the node stays in service; the run fails and says why loudly (a `stackproof ALERT:` line on stderr,
          Kubernetes labels the node fail with the reason): the image's, the settings' or the operator's
          fault, or a failure no check classified. Draining for these would empty a fleet one node at a time.
  report  the node stays in service; the run fails and the report says why (a person looks when they can).

Beside each action, the remedy: typed steps, the cheapest first, each the one to try when the one before it did
not clear the finding (NVIDIA Health Validation's recommended-action chains, e.g. reset_gpu -> service_required).
A node taken out comes back only by a re-proof after the remedy (act/resume.py); a node that keeps coming back
broken stops at the last step, `service` (act/history.py).
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

# The remedy's steps, the words a program acts on -> what a person (or a remediation controller) does.
RERUN, FIX_IMAGE, FIX_SETTINGS = "rerun", "fix-image", "fix-settings"
KILL_PROCESS, RESET_GPU, REBOOT, RESEAT, SERVICE = "kill-process", "reset-gpu", "reboot", "reseat", "service"
STEPS: dict[str, str] = {
    RERUN: "run the check again; if it fails the same way, report it with the rank's log (stackproof's or a "
           "probe's own failure, not the machine's)",
    FIX_IMAGE: "rebuild or re-pin the image (stackproof build; the pins the finding names)",
    FIX_SETTINGS: "fix the node's or the run's settings the finding names (spec, driver, shared memory, NVML access)",
    KILL_PROCESS: "kill the process left holding the GPU (nvidia-smi --query-compute-apps=pid,gpu_uuid)",
    RESET_GPU: "reset the GPU (nvidia-smi -r -i N, with nothing running on it)",
    REBOOT: "reboot the node",
    RESEAT: "reseat the GPU, its riser or the cable/transceiver of the link",
    SERVICE: "service the hardware: replace (RMA) the GPU or part, quoting its serial number",
}
# Steps that need the node out of service (no job may run on it while they are done).
OUT_OF_SERVICE_STEPS = frozenset({RESET_GPU, REBOOT, RESEAT, SERVICE})
_HW = (KILL_PROCESS, RESET_GPU, REBOOT, SERVICE)
REMEDIES: dict[tuple[str, str], tuple[str, ...]] = {
    ("gpu-hardware", "isolate"): (REBOOT, SERVICE),  # retired pages, a GPU lost: a reboot, else the part
    ("gpu-hardware", "reset"): _HW,  # a hang, a GPU held: the leftover process first
    ("gpu-hardware", "triage"): (RESET_GPU, REBOOT, SERVICE),
    ("interconnect", "isolate"): (RESEAT, SERVICE),  # a link down: its cable or riser, else the part
    ("interconnect", "reset"): (RESET_GPU, REBOOT, RESEAT, SERVICE),
    ("interconnect", "triage"): (RERUN, RESEAT, SERVICE),
    ("performance", "isolate"): (RESET_GPU, REBOOT, SERVICE),
    ("performance", "reset"): (KILL_PROCESS, RESET_GPU, REBOOT, SERVICE),
    ("performance", "triage"): (RERUN, RESET_GPU, SERVICE),
    ("software-pins", "isolate"): (FIX_IMAGE,),
    ("software-pins", "reset"): (FIX_IMAGE,),
    ("software-pins", "triage"): (FIX_IMAGE,),
    ("configuration", "isolate"): (FIX_SETTINGS,),
    ("configuration", "reset"): (KILL_PROCESS, FIX_SETTINGS),  # someone else's process on the GPU
    ("configuration", "triage"): (FIX_SETTINGS,),
    ("unclassified", "isolate"): (RERUN,),
    ("unclassified", "reset"): (RERUN,),
    ("unclassified", "triage"): (RERUN,),
    ("tool-error", "isolate"): (RERUN,),
    ("tool-error", "reset"): (RERUN,),
    ("tool-error", "triage"): (RERUN,),
}



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


def remedy(category: str, severity: str) -> tuple[str, ...]:
    """The steps for a failure of this (category, severity), cheapest first; unclassified -> rerun."""
    return REMEDIES.get((category, severity), (RERUN,))


def remedy_of(finding: Finding) -> tuple[str, ...]:
    return remedy(finding.category, finding.severity)


def remedy_words(steps: tuple[str, ...]) -> str:
    """'kill-process -> reset-gpu -> reboot -> service': the one-line form of the terminal and the page."""
    return " -> ".join(steps)


def remedy_json(finding: Finding) -> dict:
    """report.json's remedy of one finding: where, what, and the steps (step, what to do), cheapest first."""
    steps = remedy_of(finding)
    return {"node": finding.node, "gpu_index": finding.gpu_index, "uuid": finding.uuid, "rank": finding.rank,
            "check": finding.source or finding.check, "category": finding.category, "severity": finding.severity,
            "action": of(finding), "steps": [{"step": s, "do": STEPS[s]} for s in steps]}


def markdown() -> str:
    """The table as docs/act.md prints it (a test keeps the two the same)."""
    lines = ["| category | " + " | ".join(SEVERITIES) + " |", "|---|" + "---|" * len(SEVERITIES)]
    lines += [f"| {c} | " + " | ".join(TABLE[(c, s)] for s in SEVERITIES) + " |" for c in CATEGORIES]
    return "\n".join(lines)


def remedies_markdown() -> str:
    """The remedy table as docs/act.md prints it (a test keeps the two the same)."""
    lines = ["| category | " + " | ".join(SEVERITIES) + " |", "|---|" + "---|" * len(SEVERITIES)]
    lines += [f"| {c} | " + " | ".join(remedy_words(REMEDIES[(c, s)]) for s in SEVERITIES) + " |"
              for c in CATEGORIES]
    return "\n".join(lines)
