"""A node spec: what a node of one kind should be (GPU count and model, memory per GPU, NVLinks up, PCIe
generation and width, ECC, persistence and MIG modes, driver and VBIOS versions, power limit), made from
known-good runs and enforced by `validate --spec` (docs/spec.md). Like the per-SKU files of Azure's NHC.

Pure: report.json data and recorded GPU facts in, a spec or findings out. The facts are the rows of the
report table `per_gpu_facts` (one per GPU, `row_of`), written by smoke_tests/test_02_node_spec.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stackproof import __version__, files
from stackproof.errors import ConfigError
from stackproof.judge import fabric, promise
from stackproof.judge.findings import RESET, RMA, Finding

SCHEMA = "stackproof.spec/1"
TABLE = "per_gpu_facts"  # report.json's table of facts, one row per GPU
CHECK = "node_spec"
MIB = 1 << 20
KEY_FIELDS = ("gpu", "gpus_per_node")
FABRIC_CHECK = "fabric::rdma_ports_hold_their_spec"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One field of the spec: what it is in words, whose fault a mismatch is, and the fix."""

    field: str
    words: str
    category: str
    severity: str
    fix: str
    per_gpu: bool = True  # else one value per node
    kind: str = "text"  # what its value must be (KINDS): checked when a spec is read
    judged_by: str = ""  # another check holds the node to this field (the spec only records it)


# The fields, once. A wrong setting (driver, VBIOS, ECC, persistence, MIG, power limit) is configuration: the
# node's setup, put right without new hardware. Missing GPUs or memory are the GPU's hardware, links down or a
# slot below the spec's PCIe the interconnect (docs/spec.md).
RULES = (
    Rule("gpu_count", "GPUs on the node", "gpu-hardware", "isolate",
         "find the missing GPU (nvidia-smi; lspci -d 10de:; dmesg for XID 79 'fallen off the bus'); " + RMA,
         per_gpu=False, kind="count"),
    Rule("gpu_model", "GPU model", "configuration", "triage",
         "run this node against the spec entry of its own GPU model (stackproof spec REPORT... -o FILE with a "
         "known-good run of it)"),
    Rule("memory_total_mib", "memory per GPU (MiB)", "gpu-hardware", "isolate",
         "check ECC and MIG modes first (both change the memory NVML reports); otherwise " + RMA, kind="count"),
    Rule("nvlinks_up", "NVLinks up", "interconnect", "reset", "nvidia-smi nvlink -s shows the links; " + RESET,
         kind="links"),
    Rule("pcie_gen", "PCIe generation (max the slot allows)", "interconnect", "triage",
         "check the slot, riser and BIOS PCIe settings (lspci -vv: LnkCap)", kind="count"),
    Rule("pcie_width", "PCIe width (max the slot allows)", "interconnect", "triage",
         "reseat the GPU or riser and check the slot (lspci -vv: LnkCap)", kind="count"),
    Rule("ecc_enabled", "ECC mode", "configuration", "reset",
         "nvidia-smi -i <GPU> -e 1, then reset the GPU or reboot (the mode changes at the next reset)",
         kind="switch"),
    Rule("persistence_mode", "persistence mode", "configuration", "triage",
         "nvidia-smi -i <GPU> -pm 1 (or enable nvidia-persistenced)", kind="switch"),
    Rule("mig_enabled", "MIG mode", "configuration", "reset",
         "nvidia-smi -i <GPU> -mig 0 (or 1), then reset the GPU", kind="switch"),
    Rule("driver_version", "NVIDIA driver", "configuration", "triage",
         "install the spec's driver on this node (or make the spec again from runs on the new driver)",
         per_gpu=False),
    Rule("vbios_version", "VBIOS", "configuration", "triage",
         "flash the spec's VBIOS with the vendor's tool (or make the spec again from runs on the new VBIOS)"),
    Rule("power_limit_w", "enforced power limit (W)", "configuration", "triage",
         "nvidia-smi -i <GPU> -pl <watts> (and check the BMC's power capping)", kind="watts"),
    # The network (sysfs, stackproof/measure/fabric.py); fabric::rdma_ports_hold_their_spec names the port.
    Rule("fabric_ports_up", "RDMA ports up", "interconnect", "isolate", fabric.PORT_FIX, per_gpu=False,
         kind="links", judged_by=FABRIC_CHECK),
    Rule("fabric_port_rate_gbps", "RDMA port rate (Gb/s, the slowest port up)", "interconnect", "triage",
         fabric.RATE_FIX, per_gpu=False, kind="gbps", judged_by=FABRIC_CHECK),
    Rule("fabric_link_layer", "RDMA link layer", "configuration", "triage", fabric.PORT_FIX, per_gpu=False,
         judged_by=FABRIC_CHECK),
)
FIELDS = tuple(rule.field for rule in RULES)


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# What each kind of value must be, in words and as a test: a spec that says "2" or "yes" would hold a node to a
# value NVML never reports, and every node would fail (a string "2" is not the count 2).
KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "text": ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip())),
    "count": ("a whole number >= 1", lambda v: _whole(v, 1)),
    "links": ("a whole number >= 0", lambda v: _whole(v, 0)),
    "switch": ("true or false", lambda v: isinstance(v, bool)),
    "watts": ("a number of watts > 0", lambda v: _number(v) and math.isfinite(v) and v > 0),
    "gbps": ("a number of Gb/s > 0", lambda v: _number(v) and math.isfinite(v) and v > 0),
}
ALLOWED = {"spec": ("schema", "stackproof", "created", "entries"), "entry": ("key", "reports", "expect"),
           "key": KEY_FIELDS}
RULE = {rule.field: rule for rule in RULES}

# From a GPU as NVML described it (topology.Gpu) to its row. None: NVML did not say.
_FROM_GPU: dict[str, Callable[[Any], Any]] = {
    "gpu_model": lambda gpu: gpu.name,
    "memory_total_mib": lambda gpu: gpu.memory_total_bytes // MIB if gpu.memory_total_bytes else None,
    "nvlinks_up": lambda gpu: gpu.nvlink_active,
    "pcie_gen": lambda gpu: gpu.pcie_gen or None,
    "pcie_width": lambda gpu: gpu.pcie_width or None,
    "ecc_enabled": lambda gpu: gpu.ecc_enabled,
    "persistence_mode": lambda gpu: gpu.persistence_mode,
    "mig_enabled": lambda gpu: gpu.mig_enabled,
    "vbios_version": lambda gpu: gpu.vbios_version,
    "power_limit_w": lambda gpu: None if gpu.power_limit_w is None else round(gpu.power_limit_w, 1),
}


def row_of(gpu: Any, driver_version: str | None, node: str, rank: int,
           fabric_facts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One GPU's facts as a row of `per_gpu_facts`. A reading NVML could not give stays None, and the NVML
    errors behind it are kept (`nvml_errors`), so a spec check names them instead of guessing. `fabric_facts`:
    its node's network (judge/fabric.py node_facts), the same on every row of the node."""
    row = {"node": node, "rank": rank, "gpu": gpu.index, "uuid": gpu.uuid, "driver_version": driver_version}
    row.update(fabric_facts or fabric.node_facts(None))
    row.update({name: read(gpu) for name, read in _FROM_GPU.items()})
    row["nvml_errors"] = dict(getattr(gpu, "nvml_errors", {}) or {})
    return row


def unread_row(node: str, rank: int, error: str) -> dict[str, Any]:
    """The row of a GPU whose facts could not be read (NVML lost, an unknown error): every fact None and the
    error kept, so the spec check names it as a finding on that rank."""
    row = {"node": node, "rank": rank, "gpu": None, "uuid": "", "driver_version": None}
    row.update(fabric.node_facts(None))
    row.update(dict.fromkeys(_FROM_GPU))
    row["nvml_errors"] = {"GPU facts": error}
    return row


def by_node(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    nodes: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        nodes.setdefault(str(row.get("node")), []).append(row)
    return nodes


def node_facts(rows: Sequence[Mapping[str, Any]], skipped: int = 0) -> dict[str, Any]:
    """The node-wide facts of one node's rows: its GPU count (with the `skipped` GPUs a job was using, which the
    run left alone: there, not measured), and its driver (the first that answered)."""
    drivers = [r.get("driver_version") for r in rows if r.get("driver_version")]
    network = {f: next((r[f] for r in rows if r.get(f) is not None), None) for f in fabric.node_facts(None)}
    return {"gpu_count": len(rows) + skipped, "driver_version": drivers[0] if drivers else None, **network}


def key_of(rows: Sequence[Mapping[str, Any]], skipped: int = 0) -> dict[str, Any]:
    """What a spec entry is for, like a baseline's key: the GPU model(s) and the GPUs per node (the skipped
    ones too: a node running a job on some of its GPUs is still a node of its kind)."""
    models = sorted({str(r["gpu_model"]) for r in rows if r.get("gpu_model")}) or ["unknown"]
    return {"gpu": "+".join(models), "gpus_per_node": len(rows) + skipped}


def key_text(key: Mapping[str, Any]) -> str:
    return f"{key['gpu']} x {key['gpus_per_node']}"


def _text(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


# Making a spec from known-good runs.

def refuse_unless_good(source: str, report: Mapping[str, Any]) -> None:
    """A report without GPU facts (a CPU run) has nothing to make a spec from; a spec made from failing runs
    would hold later runs to a broken machine. Both refused, exit 2."""
    if not (report.get("tables") or {}).get(TABLE):
        raise ConfigError(f"{source}: field 'tables.{TABLE}': expected each GPU's facts (written by the "
                          f"{CHECK} checks of a run on GPUs), found none; fix: give reports of `stackproof validate` "
                          "on the GPUs (--tier fast is enough), not CPU runs or runs of an older stackproof")
    promise.require_known_good(source, report, "spec")


def make_spec(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The spec from known-good reports (source name -> report.json data): one entry per key. Every field must
    have one value over every GPU (node) of every report of a key; values that differ are an error naming
    each value and where it was found: a spec cannot say which of them is right."""
    entries: dict[str, dict[str, Any]] = {}
    seen: dict[str, dict[str, dict[Any, list[str]]]] = {}  # key -> field -> value -> where
    for source, report in reports.items():
        refuse_unless_good(source, report)
        for node, rows in by_node(report["tables"][TABLE]).items():
            key = key_of(rows)
            name = key_text(key)
            entry = entries.setdefault(name, {"key": key, "reports": []})
            if source not in entry["reports"]:
                entry["reports"].append(source)
            values = seen.setdefault(name, {})
            for field, value in node_facts(rows).items():
                values.setdefault(field, {}).setdefault(value, []).append(f"{node} ({source})")
            for row in rows:
                for field in FIELDS:
                    if RULE[field].per_gpu:
                        values.setdefault(field, {}).setdefault(row.get(field), []).append(
                            f"{node} GPU {row.get('gpu')} ({source})")
    for name, entry in entries.items():
        differ = {field: found for field, found in seen[name].items() if len(found) > 1}
        if differ:
            said = "; ".join(f"{field}: " + ", ".join(f"{_text(v)} on {_first(where)}" for v, where in found.items())
                             for field, found in differ.items())
            raise ConfigError(f"{name}: expected one value of each field over the known-good runs, found {said}; "
                              "fix: leave out the reports of the odd nodes (or put the odd nodes right and run "
                              "them again)")
        entry["expect"] = {field: next(iter(seen[name][field])) for field in FIELDS}
    return {"schema": SCHEMA, "stackproof": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "entries": list(entries.values())}


def unheld(made: Mapping[str, Any]) -> list[str]:
    """What a spec made from runs where NVML gave no reading will not hold (a null field is not compared, an
    unknown model matches no named one), one warning per entry: said when the spec is made, not found out when
    a bad node passes."""
    said = []
    for entry in made["entries"]:
        # Only NVML's fields: a null fabric field is a node without RDMA ports, read from sysfs, not a gap.
        missing = [rule.field for rule in RULES if not rule.judged_by and entry["expect"].get(rule.field) is None]
        name = key_text(entry["key"])
        if missing:
            said.append(f"{name}: the known-good runs have no reading of {', '.join(missing)} (NVML gave none): "
                        "this spec will not hold nodes to them (null: not compared); fix: make it from runs where "
                        "NVML answers (their report.json's per_gpu_facts rows name its errors), or leave it so on "
                        "purpose")
        if entry["key"]["gpu"] == "unknown":
            said.append(f"{name}: the known-good runs have no GPU model (NVML gave no name): only nodes whose "
                        "model NVML cannot name either match this entry by model")
    return said


def _first(where: list[str]) -> str:
    return where[0] + (f" (+{len(where) - 1} more)" if len(where) > 1 else "")


# Reading a spec file.

def parse(data: Any, source: str) -> dict[str, Any]:
    """A spec, checked field by field, types and values: ConfigError (exit 2) naming the source and the field."""
    def bad(field: str, expected: str, found: Any) -> ConfigError:
        return ConfigError(f"--spec {source}: field {field}: expected {expected}, found {found!r}; fix: make it "
                           "again with `stackproof spec REPORT... -o FILE` (docs/spec.md), or correct that field")

    def known_only(where: str, obj: dict, allowed: Sequence[str]) -> None:
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise bad(f"'{where}{unknown[0]}'", f"only the fields {', '.join(allowed)}", obj[unknown[0]])

    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise bad("'schema'", repr(SCHEMA), data.get("schema") if isinstance(data, dict) else data)
    known_only("", data, ALLOWED["spec"])
    if not isinstance(data.get("entries"), list) or not data["entries"]:
        raise bad("'entries'", "a non-empty list", data.get("entries"))
    keys: dict[str, int] = {}
    for i, entry in enumerate(data["entries"]):
        if not isinstance(entry, dict):
            raise bad(f"'entries[{i}]'", "an object with key and expect", entry)
        known_only(f"entries[{i}].", entry, ALLOWED["entry"])
        key = entry.get("key")
        if not isinstance(key, dict) or not KINDS["text"][1](key.get("gpu")) or not _count(key.get("gpus_per_node")):
            raise bad(f"'entries[{i}].key'", "an object with gpu (a model) and gpus_per_node (a count)", key)
        known_only(f"entries[{i}].key.", key, ALLOWED["key"])
        if key_text(key) in keys:
            raise bad(f"'entries[{i}].key'", f"one entry per key (entries[{keys[key_text(key)]}] is also "
                                             f"{key_text(key)})", key)
        keys[key_text(key)] = i
        expect = entry.get("expect")
        if not isinstance(expect, dict):
            raise bad(f"'entries[{i}].expect'", f"an object of {', '.join(FIELDS)}", expect)
        known_only(f"entries[{i}].expect.", expect, FIELDS)
        if all(value is None for value in expect.values()):
            raise bad(f"'entries[{i}].expect'", "at least one field that is not null (a null field is not "
                                                "compared: this entry would hold a node to nothing)", expect)
        for field, value in expect.items():
            words, fits = KINDS[RULE[field].kind]
            if value is not None and not fits(value):
                raise bad(f"'entries[{i}].expect.{field}'", f"{words} or null", value)
        if expect.get("gpu_count") not in (None, key["gpus_per_node"]):
            raise bad(f"'entries[{i}].expect.gpu_count'", f"the key's gpus_per_node ({key['gpus_per_node']}) or "
                                                          "null", expect["gpu_count"])
    return data


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    data = files.read_json(path, "a node spec JSON made by `stackproof spec`", "name the file `stackproof spec "
                           "REPORT... -o FILE` wrote (make one from known-good runs: docs/spec.md)", flag="--spec",
                           finite=True)
    return parse(data, str(path))


problem = files.load_problem(load, "--spec")  # for the settings' check


# Judging a node.

def entry_for(spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], skipped: int = 0
              ) -> tuple[dict[str, Any] | None, Finding | None]:
    """(the entry a node is judged by, None) or (None, the finding that none fits). The same model and count
    first; else the one entry of the model (a node that lost a GPU is judged by its model's entry)."""
    key = key_of(rows, skipped)
    entries = spec["entries"]
    exact = next((e for e in entries if e["key"] == key), None)
    if exact is not None:
        return exact, None
    model = [e for e in entries if e["key"]["gpu"] == key["gpu"]]
    if len(model) == 1:
        return model[0], None
    if model:
        rule = RULE["gpu_count"]
        expected = "one of " + ", ".join(str(e["key"]["gpus_per_node"]) for e in model) + f" {key['gpu']} GPUs"
        found = str(len(rows) + skipped)
    else:
        rule = RULE["gpu_model"]
        expected = "a model the spec has (" + ", ".join(key_text(e["key"]) for e in entries) + ")"
        found = key["gpu"]
    return None, Finding(None, "", f"{CHECK} {rule.words}", expected, found, rule.category, rule.severity, rule.fix)


def judge_spec(spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], skipped: int = 0) -> list[Finding]:
    """Every way one node's GPU facts (its rows of `per_gpu_facts`) differ from its spec entry: expected,
    found and the fix, per field. A spec field that is null is not compared; a fact NVML did not give (None,
    with its NVML error) when the spec expects a value is a finding, never a pass. `skipped`: GPUs of the node
    left out of the run because a job uses them (healthcheck --skip-busy-gpus): counted, not judged."""
    if not rows:
        return [Finding(None, "", f"{CHECK} GPUs on the node", "GPUs to judge", "no GPU facts", "gpu-hardware",
                        "isolate", RULE["gpu_count"].fix)]
    entry, unfit = entry_for(spec, rows, skipped)
    if entry is None:
        return [unfit]
    expect, findings = entry["expect"], []
    node = node_facts(rows, skipped)
    for rule in RULES:
        want = expect.get(rule.field)
        if want is None or rule.judged_by:
            continue
        if not rule.per_gpu:
            found = node[rule.field]
            if found != want:
                findings.append(Finding(None, "", f"{CHECK} {rule.words}", _text(want),
                                        _text(found) + _nvml_said(rows, found), rule.category, rule.severity,
                                        rule.fix))
            continue
        for row in rows:
            found = row.get(rule.field)
            if found != want and not (_number(found) and _number(want) and abs(found - want) < 0.05):
                findings.append(Finding(row.get("gpu"), str(row.get("uuid", "")), f"{CHECK} {rule.words}",
                                        _text(want), _text(found) + _nvml_said([row], found),
                                        *_severity(rule, found, want)))
    return findings


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _severity(rule: Rule, found: Any, want: Any) -> tuple[str, str, str]:
    """More memory than the spec is a different board or mode, not a fault: configuration."""
    if rule.field == "memory_total_mib" and _number(found) and found > want:
        return "configuration", "triage", RULE["gpu_model"].fix
    return rule.category, rule.severity, rule.fix


def _nvml_said(rows: Sequence[Mapping[str, Any]], found: Any) -> str:
    """Where a reading is None, the NVML errors of its GPU(s): why it is n/a."""
    if found is not None:
        return ""
    errors = sorted({f"{what}: {text}" for row in rows for what, text in (row.get("nvml_errors") or {}).items()})
    return f" ({'; '.join(errors)})" if errors else ""


def odd_nodes(facts_by_node: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, list[Finding]]:
    """Without a spec: the nodes whose driver differs from the other nodes' (counted per node), and the GPUs whose
    VBIOS differs from the other GPUs of their model (counted per GPU). The majority is expected; with no single
    majority (a tie) every node is named, since none can be trusted over the others."""
    found: dict[str, list[Finding]] = {}
    if len(facts_by_node) < 2:
        return found
    drivers = {node: node_facts(rows)["driver_version"] for node, rows in facts_by_node.items()}
    majority = _majority(Counter(drivers.values()))
    for node, driver in drivers.items():
        if majority is None or driver != majority:
            others = ", ".join(f"{d} on {n}" for n, d in drivers.items() if d != driver)
            expected = (f"the driver of the other nodes ({majority})" if majority is not None else
                        f"one driver on every node (a tie: {others})")
            found.setdefault(node, []).append(Finding(None, "", f"{CHECK} NVIDIA driver", expected, _text(driver),
                                                      "configuration", "triage",
                                                      "install one driver version on every node of the job"))
    models = {str(row.get("gpu_model")) for rows in facts_by_node.values() for row in rows}
    for model in sorted(models):
        gpus = [(node, row) for node, rows in facts_by_node.items() for row in rows
                if str(row.get("gpu_model")) == model]
        if len({node for node, _ in gpus}) < 2:
            continue
        majority = _majority(Counter(row.get("vbios_version") for _, row in gpus))
        for node, row in gpus:
            if majority is None or row.get("vbios_version") != majority:
                expected = (f"the VBIOS of the other {model} GPUs ({majority})" if majority is not None else
                            f"one VBIOS on every {model} (a tie between "
                            f"{', '.join(sorted({_text(r.get('vbios_version')) for _, r in gpus}))})")
                found.setdefault(node, []).append(Finding(
                    row.get("gpu"), str(row.get("uuid", "")), f"{CHECK} VBIOS", expected,
                    _text(row.get("vbios_version")), "configuration", "triage",
                    "flash one VBIOS version on every GPU of the model (the vendor's tool)"))
    return found


def _majority(counts: Counter) -> Any:
    """The one most common value; None on a tie."""
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]
