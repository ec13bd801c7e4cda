"""Kubernetes: through kubectl (the cluster's own client; it finds its credentials as it always does: the pod's
service account in a pod, else the kubeconfig), every node of the run gets the label stackproof.io/verdict=pass
or =fail; a failed node also gets its reason as an annotation, and a node to drain the taint
stackproof.io/unhealthy=true:NoSchedule. A check never lifts the taint: only the re-proof of a tainted node does
(act/resume.py), as it resumes a drained node on Slurm.

A run that acted on nothing (it did not complete, bad input, a stale report) labels the node
stackproof.io/verdict=incomplete, so no earlier `pass` stays on it. Before a taint the node claims its place in a
ConfigMap (--breaker-configmap), replaced only at the resourceVersion it read: two nodes tainting at once
cannot both pass the cap (breaker.claim decides, the API server orders)."""

from __future__ import annotations

import json

from stackproof.act.breaker import CLAIMS_KEY, Fleet
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
INCOMPLETE = "incomplete"  # the verdict label of a run that acted on nothing
# kubectl's words for a lost compare-and-swap (`Error from server (Conflict)`: another node replaced the ConfigMap
# after we read it; `(AlreadyExists)`: another created it first) and for a ConfigMap not there yet.
LOST_RACE = ("(Conflict)", "(AlreadyExists)")
ABSENT = "(NotFound)"


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
    items = _nodes(nodes_json)
    labels = {i["metadata"]["name"]: i["metadata"].get("labels") or {} for i in items}
    key, value = POOL_LABEL
    gpu_pool = any(labels.get(t, {}).get(key) == value for t in targets)
    pool = {name for name, lab in labels.items() if not gpu_pool or lab.get(key) == value}
    tainted = {i["metadata"]["name"] for i in items
               if any(t.get("key") == TAINT_KEY for t in (i.get("spec") or {}).get("taints") or [])}
    return Fleet(frozenset(pool), frozenset(tainted & pool))


def _nodes(nodes_json: str) -> list[dict]:
    """FLEET's output as a list of Node objects, each with metadata.name (and, if any, labels and taints of
    their shape); anything else a ValueError saying what kubectl printed instead (a proxy's HTML page, an
    error text, another kind of list), so the breaker can say why it could not count."""
    def odd(found: str) -> ValueError:
        return ValueError(f"`{' '.join(FLEET)}` printed {found}, expected a NodeList (an object whose items are "
                          "Nodes with metadata.name); fix: check that kubectl talks to the cluster's API server "
                          "(kubectl get nodes) with the context it is given")

    try:
        data = json.loads(nodes_json)
    except ValueError:
        raise odd(f"text that is not JSON ({nodes_json.strip()[:60]!r})") from None
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise odd(f"JSON without a list of items ({type(data).__name__}: {str(data)[:60]!r})")
    for i, item in enumerate(items):
        meta = item.get("metadata") if isinstance(item, dict) else None
        spec = item.get("spec") if isinstance(item, dict) else None
        if (not isinstance(meta, dict) or not isinstance(meta.get("name"), str)
                or not isinstance(meta.get("labels") or {}, dict) or not isinstance(spec or {}, dict)
                or not isinstance((spec or {}).get("taints") or [], list)
                or not all(isinstance(t, dict) for t in (spec or {}).get("taints") or [])):
            raise odd(f"items[{i}] that is not a Node of that shape ({str(item)[:60]!r})")
    return items


def incomplete_commands(node: str, why: str, target: list[str] | None = None) -> list[list[str]]:
    """A run that acted on nothing: the node's verdict label says so (an old `pass` would lie), with why."""
    where = target or ["node", node]
    return [["kubectl", "label", *where, f"{VERDICT_LABEL}={INCOMPLETE}", "--overwrite"],
            ["kubectl", "annotate", *where, f"{CHECK_ANNOTATION}={why}", "--overwrite"]]


def _where(configmap: str) -> tuple[str, str]:
    namespace, _, name = configmap.partition("/")
    return namespace, name


def claim_read(configmap: str) -> list[str]:
    namespace, name = _where(configmap)
    return ["kubectl", "get", "configmap", name, "--namespace", namespace, "-o", "json"]


def claims_of(configmap_json: str | None) -> tuple[str, dict | None]:
    """`claim_read`'s output (None: not found) -> (the claims' JSON text, the object to replace)."""
    if configmap_json is None:
        return "{}", None
    obj = json.loads(configmap_json)
    return (obj.get("data") or {}).get(CLAIMS_KEY, "{}"), obj


def claim_write(configmap: str, current: dict | None, data: dict[str, str]) -> tuple[list[str], str]:
    """The argv and stdin that write the claims: `replace` at the resourceVersion read (the API server refuses it
    with Conflict when another node wrote in between), or `create` when there was no ConfigMap (AlreadyExists
    when another node created it first). Either refusal: read again and decide again."""
    namespace, name = _where(configmap)
    metadata: dict = {"name": name, "namespace": namespace}
    if current is not None:
        metadata["resourceVersion"] = current["metadata"]["resourceVersion"]
    body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    verb = "replace" if current is not None else "create"
    return ["kubectl", verb, "-f", "-", "-o", "name"], body
