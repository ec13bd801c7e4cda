"""The node's network in the fast tier (a Prolog's): each RDMA port's state, rate and link flaps against the node
spec (else the job's other nodes, else the node's own ports), from sysfs alone: no traffic, a few files per port.
Local rank 0 of each node reads its node (stackproof/measure/fabric.py); stackproof/judge/fabric.py decides.
The facts go into report.json (table `fabric`, context `fabric`), where the cross-node bars of the bandwidth and
pairwise checks and `stackproof spec` find them."""

import pytest

from stackproof.judge import fabric as rules
from stackproof.judge import spec as node_spec
from stackproof.judge.findings import Judged
from stackproof.judge.promise import FAST, Needs
from stackproof.measure import fabric

pytestmark = pytest.mark.check(FAST, Needs(),
                               optional="a node without RDMA ports has none to judge")


def _spec_expect(settings, models: list[str]) -> dict | None:
    """The fabric fields of this node's spec entry (by its GPU model and count), or None without --spec."""
    if not settings.spec:
        return None
    entry, _ = node_spec.entry_for(node_spec.load(settings.spec), [{"gpu_model": m} for m in models])
    return (entry or {}).get("expect")


def test_rdma_ports_hold_their_spec(dist_env, settings, report):
    node = dist_env.node
    model = None
    if dist_env.is_gpu:
        import torch

        model = torch.cuda.get_device_name(dist_env.device)
    fabrics = fabric.job_fabrics(dist_env, settings.sysfs, node)
    models = dist_env.agree({"node": node, "model": model}, "the GPU models per node",
                            lambda values: {v["node"]: [w["model"] for w in values if w["node"] == v["node"]]
                                            for v in values})
    report.context("fabric", fabrics)
    report.table("fabric", [{"node": n, **rules.node_facts(f), "nics": rules.describe(f), "peermem": f["peermem"]}
                            for n, f in sorted(fabrics.items())])
    mine = fabrics.get(node) or {"ports": [], "ethernet": [], "peermem": False}
    report.figure("nics", rules.describe(mine))
    expect_spec = _spec_expect(settings, [m for m in models.get(node, []) if m]) if dist_env.is_gpu else None
    if not mine["ports"] and not (expect_spec or {}).get("fabric_ports_up"):
        pytest.skip(f"no RDMA port in sysfs ({settings.sysfs}/class/infiniband): no InfiniBand/RoCE port to judge; "
                    f"this node's NICs: {rules.describe(mine)}")
    expect = rules.expectation(mine, [f for n, f in fabrics.items() if n != node], expect_spec)
    report.figure("ports_up", len(rules.up_ports(mine)))
    if expect.get("rate_gbps"):
        report.figure("expected_rate", expect["rate_gbps"], "Gb/s")
    return Judged(rules.port_findings(mine, expect, settings.max_link_downed), where=node,
                  hint="act on each finding's fix; ibstat and iblinkinfo on the node show the same ports")
