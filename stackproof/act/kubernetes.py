"""Kubernetes: through kubectl (the cluster's own client; it finds its credentials as it always does: the pod's
service account in a pod, else the kubeconfig), every node of the run gets the label stackproof.io/verdict=pass
or =fail; a failed node also gets its reason as an annotation, and a node to drain the taint
stackproof.io/unhealthy=true:NoSchedule. A passing run never lifts the taint: the person who repaired the node
does (`kubectl taint node N stackproof.io/unhealthy-`), as `scontrol update state=resume` does on Slurm."""

from __future__ import annotations

import json

from stackproof.act.breaker import Fleet
from stackproof.act.decide import NodeAction

DOMAIN = "stackproof.io"
VERDICT_LABEL = f"{DOMAIN}/verdict"
CHECK_ANNOTATION = f"{DOMAIN}/failed-check"
TAINT_KEY = f"{DOMAIN}/unhealthy"
TAINT = f"{TAINT_KEY}=true:NoSchedule"
# The GPU node pool: the DaemonSet's nodeSelector (GPU Feature Discovery's label).
POOL_LABEL = ("nvidia.com/gpu.present", "true")
FIX = ("give kubectl a context that may list, get and patch nodes (in a pod: the ServiceAccount of "
       "scripts/kubernetes/daemonset.yaml), and the node's Kubernetes name (--node, spec.nodeName)")
FLEET = ["kubectl", "get", "nodes", "-o", "json"]


def commands(action: NodeAction, target: list[str] | None = None) -> list[list[str]]:
    """The kubectl commands for one node. `target` replaces `node NAME` (e.g. `-f node.json --local -o json`
    to see the result on a Node object without a cluster)."""
    where = target or ["node", action.node]
    if not action.failed:
        return [["kubectl", "label", *where, f"{VERDICT_LABEL}=pass", "--overwrite"],
                ["kubectl", "annotate", *where, f"{CHECK_ANNOTATION}-"]]
    marked = [["kubectl", "label", *where, f"{VERDICT_LABEL}=fail", "--overwrite"],
              ["kubectl", "annotate", *where, f"{CHECK_ANNOTATION}={action.reason}", "--overwrite"]]
    return [*marked, ["kubectl", "taint", *where, TAINT, "--overwrite"]] if action.drain else marked


def fleet(nodes_json: str, targets: set[str]) -> Fleet:
    """FLEET's output -> the GPU node pool (every node when no target carries POOL_LABEL), and which of them
    carry stackproof's taint."""
    items = json.loads(nodes_json).get("items", [])
    labels = {i["metadata"]["name"]: i["metadata"].get("labels") or {} for i in items}
    key, value = POOL_LABEL
    gpu_pool = any(labels.get(t, {}).get(key) == value for t in targets)
    pool = {name for name, lab in labels.items() if not gpu_pool or lab.get(key) == value}
    tainted = {i["metadata"]["name"] for i in items
               if any(t.get("key") == TAINT_KEY for t in (i.get("spec") or {}).get("taints") or [])}
    return Fleet(frozenset(pool), frozenset(tainted & pool))
