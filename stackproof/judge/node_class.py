"""A node class: what kind of node a validation proves an image on, and what a gate asks for (docs/attest.md).

GPU model x GPUs per node, the NVIDIA driver and the newest CUDA it supports, the NICs where known, and the
node spec's name when the run used one. Pure: a run's record or this node's NVML facts in, a class out; and the
rule that says whether an attested class is the one a node has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stackproof.errors import ConfigError

NO_GPU = "none"  # the GPU model of a CPU run (gloo ranks)
# The text form's keys, in the order they are written: `gpu=NVIDIA H200;gpus=8;driver=580.159.04;cuda=13.0`.
KEYS = ("gpu", "gpus", "driver", "cuda", "nics", "spec")


@dataclasses.dataclass(frozen=True)
class NodeClass:
    gpu: str  # the GPU model NVML names ("NVIDIA H200"), NO_GPU for CPU ranks
    gpus: int  # GPUs on the node
    driver: str | None = None  # NVIDIA driver version
    cuda: str | None = None  # the newest CUDA the driver supports
    nics: str | None = None  # "8 x 400 Gb/sec InfiniBand" (measure/nics.py); None: none known
    spec: str | None = None  # the node spec's file name, when the run used one

    def text(self) -> str:
        """The form --node-class takes and every message prints."""
        return ";".join(f"{key}={value}" for key, value in self.to_json().items() if value is not None)

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in KEYS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeClass:
        return cls(**{key: data.get(key) for key in KEYS if key in data})


def parse(text: str) -> NodeClass:
    """`gpu=NVIDIA H200;gpus=8;driver=580.159.04;cuda=13.0[;nics=...][;spec=...]` (NodeClass.text); exit 2 naming
    the part that does not fit."""
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in KEYS:
            raise ConfigError(f"--node-class {text!r}: expected key=value parts with keys {', '.join(KEYS)}, found "
                              f"{part!r}; fix: copy the class `stackproof node-class` prints on such a node")
        fields[key.strip()] = value.strip()
    if "gpu" not in fields or "gpus" not in fields or not str(fields["gpus"]).isdigit():
        raise ConfigError(f"--node-class {text!r}: expected at least gpu=MODEL;gpus=N (N a whole number), found "
                          f"{sorted(fields) or 'nothing'}; fix: e.g. --node-class 'gpu=NVIDIA H200;gpus=8;"
                          "driver=580.159.04;cuda=13.0', or leave it out to read this node's class from NVML")
    fields["gpus"] = int(fields["gpus"])
    return NodeClass(**fields)


def of_gpus(models: list[str], driver: str | None, cuda: str | None, nics: str | None) -> NodeClass:
    """The class of a node with these GPUs (one model name each) and driver; no GPU: the CPU class (gloo ranks,
    whose figures do not depend on the NICs)."""
    if not models:
        return NodeClass(NO_GPU, 0)
    return NodeClass("+".join(sorted(set(models))), len(models), driver, cuda, nics)


class UnknownClass(ConfigError):
    """The run's record does not say what its nodes were (exit 2): attesting it would prove nothing."""


def of_run(ranks: list[Mapping[str, Any]], context: Mapping[str, Any], settings: Mapping[str, Any]) -> NodeClass:
    """The class of the nodes a run's record (Report.ranks, .context, .settings) names: every node must be of one
    class, and a GPU run must have recorded its driver (the gpus checks)."""
    gpus_by_node: dict[str, dict[str, str]] = {}
    for ident in ranks:
        found = gpus_by_node.setdefault(str(ident.get("node")), {})
        gpu = ident.get("gpu") or {}
        if gpu.get("uuid"):
            found[gpu["uuid"]] = str(gpu.get("name") or "unknown")
    if not gpus_by_node:
        raise UnknownClass("the run's record names no rank: expected the ranks' nodes and GPUs, found none; fix: "
                           "attest a run that started its ranks (its report.json lists them under 'ranks')")
    driver = context.get("driver") or {}
    spec = Path(settings["spec"]).name if settings.get("spec") else None
    classes = {node: dataclasses.replace(of_gpus(list(gpus.values()), driver.get("version"), driver.get("cuda"),
                                                 context.get("nics")), spec=spec)
               for node, gpus in gpus_by_node.items()}
    distinct = {c.text() for c in classes.values()}
    if len(distinct) > 1:
        raise UnknownClass("the run's nodes are of different classes: " + "; ".join(
            f"{node}: {c.text()}" for node, c in classes.items()) + "; fix: attest runs of one class of node each")
    made = next(iter(classes.values()))
    if made.gpu != NO_GPU and not (made.driver and made.cuda):
        raise UnknownClass(f"the run ran on {made.gpu} x {made.gpus} but recorded no driver (context.driver: "
                           f"{dict(driver) or 'none'}); fix: attest a run whose selection kept the gpus checks "
                           "(gpus::torch_sees_the_expected_gpus records the driver)")
    return made


def differences(attested: NodeClass, wanted: NodeClass) -> list[str]:
    """What the attested class has that the wanted one does not: every field, except the spec, which counts only
    when the wanted class names one. Empty: the same class."""
    keys = [k for k in KEYS if k != "spec" or wanted.spec is not None]
    def shown(value: Any) -> str:
        return "unknown" if value is None else str(value)

    return [f"{key} {shown(getattr(attested, key))} (this node: {shown(getattr(wanted, key))})" for key in keys
            if getattr(attested, key) != getattr(wanted, key)]
