"""Each node's GPUs against what the node should be (--spec, a node spec made from known-good runs:
docs/spec.md), and the nodes of the job against each other (driver, VBIOS). Each rank reads its own GPU's facts
through NVML, by the UUID torch gives its device; the facts go into report.json's table `per_gpu_facts`, which
`stackproof spec` makes a spec from. The judgement is stackproof/judge/spec.py's."""

import pytest
import torch

from stackproof.judge import fabric as network
from stackproof.judge import findings as judged
from stackproof.judge import spec as node_spec
from stackproof.judge.promise import FAST, Needs
from stackproof.measure import fabric, health, topology

pytestmark = pytest.mark.check(FAST, Needs(gpu=True))


def _read_own(device: torch.device, node: str, rank: int, sysfs: str) -> dict:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    with topology.nvml_session() as nvml:
        gpu = topology.read_gpu(nvml, nvml.nvmlDeviceGetIndex(health.handle_of(nvml, uuid)))
        driver = topology.optional(nvml, gpu.nvml_errors, "driver version", nvml.nvmlSystemGetDriverVersion)
    return node_spec.row_of(gpu, None if driver is None else str(driver), node, rank,
                            network.node_facts(fabric.read(sysfs).to_json()))


@pytest.fixture(scope="module")
def facts(dist_env, settings):
    """(this rank's row, every rank's rows). A GPU NVML cannot read is a row of n/a with the error: a finding
    of the checks below, never a traceback and never a pass."""
    node = dist_env.node
    try:
        mine = _read_own(dist_env.device, node, dist_env.rank, settings.sysfs)
    except Exception as err:  # NVML missing, the GPU lost, an unknown error: said in the row
        mine = node_spec.unread_row(node, dist_env.rank, f"{type(err).__name__}: {err}")
    return mine, dist_env.agree(mine, "the GPU facts", decide=lambda rows: rows)


def _mine(found: list[judged.Finding], mine: dict) -> list[judged.Finding]:
    """The findings that are this rank's: about its node as a whole, or about its GPU."""
    return [f for f in found if f.gpu_index is None or (f.uuid and f.uuid == mine["uuid"])]


def _judge(found_by_node: dict, mine: dict) -> judged.Judged:
    return judged.Judged(_mine(found_by_node.get(mine["node"], []), mine), where=mine["node"],
                         hint="act on each finding's fix; nvidia-smi -q on the node shows the same NVML records")


# Runs without --spec too: its table of the node's facts is what `stackproof spec` makes a spec from.
@pytest.mark.check(FAST, Needs(gpu=True), optional="no --spec given: nothing says what this node should be",
                   promised_by="spec")
def test_matches_the_spec(facts, dist_env, settings, report):
    mine, rows = facts
    report.table(node_spec.TABLE, rows)
    if not settings.spec:
        pytest.skip("no --spec given: nothing says what this node should be (make one from known-good runs: "
                    "stackproof spec REPORT... -o FILE)")
    known = node_spec.load(settings.spec)  # checked at start-up; read again here, on the rank that needs it
    nodes = node_spec.by_node(rows)
    # GPUs a job uses that this node's run left alone (healthcheck --skip-busy-gpus): counted as there.
    skipped = {mine["node"]: settings.skipped_gpu_count}
    entry, _ = node_spec.entry_for(known, nodes[mine["node"]], skipped[mine["node"]])
    report.figure("spec_entry", node_spec.key_text(entry["key"]) if entry else "none")
    if skipped[mine["node"]]:
        report.figure("skipped_gpus", settings.skipped_gpus)
    return _judge({node: node_spec.judge_spec(known, node_rows, skipped.get(node, 0))
                   for node, node_rows in nodes.items()}, mine)


@pytest.mark.check(FAST, Needs(gpu=True, nodes=2))
def test_nodes_agree_on_driver_and_vbios(facts, dist_env, report):
    mine, rows = facts
    report.table(node_spec.TABLE, rows)
    report.figure("nodes", dist_env.num_nodes)
    return _judge(node_spec.odd_nodes(node_spec.by_node(rows)), mine)
