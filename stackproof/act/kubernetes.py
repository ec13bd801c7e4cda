"""Kubernetes: through kubectl (the cluster's own client; it finds its credentials as it always does: the pod's
service account in a pod, else the kubeconfig), every node of the run gets the label stackproof.io/verdict=pass
or =fail; a failed node also gets the failing check as an annotation and the taint
stackproof.io/unhealthy=true:NoSchedule. A passing run never lifts the taint: the person who repaired the node
does (`kubectl taint node N stackproof.io/unhealthy-`), as `scontrol update state=resume` does on Slurm."""

from __future__ import annotations

from stackproof.act.decide import NodeAction

DOMAIN = "stackproof.io"
VERDICT_LABEL = f"{DOMAIN}/verdict"
CHECK_ANNOTATION = f"{DOMAIN}/failed-check"
TAINT_KEY = f"{DOMAIN}/unhealthy"
TAINT = f"{TAINT_KEY}=true:NoSchedule"
FIX = ("give kubectl a context that may get and patch nodes (in a pod: the ServiceAccount of "
       "scripts/kubernetes/daemonset.yaml), and the node's Kubernetes name (--node, spec.nodeName)")


def commands(action: NodeAction, target: list[str] | None = None) -> list[list[str]]:
    """The kubectl commands for one node. `target` replaces `node NAME` (e.g. `-f node.json --local -o json`
    to see the result on a Node object without a cluster)."""
    where = target or ["node", action.node]
    if not action.failed:
        return [["kubectl", "label", *where, f"{VERDICT_LABEL}=pass", "--overwrite"],
                ["kubectl", "annotate", *where, f"{CHECK_ANNOTATION}-"]]
    return [["kubectl", "label", *where, f"{VERDICT_LABEL}=fail", "--overwrite"],
            ["kubectl", "annotate", *where, f"{CHECK_ANNOTATION}={action.reason}", "--overwrite"],
            ["kubectl", "taint", *where, TAINT, "--overwrite"]]

