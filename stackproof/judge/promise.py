"""No PASS without a judgement: what a run promises, derived from each check's own declaration
(docs/report-format.md, "What a run promises").

Each smoke test declares itself next to its code, once: the tiers it belongs to, what it needs to be judged at
all (GPU ranks, ranks, ranks on one node, nodes, a setting a person gives, a torch API), and, when a healthy
machine that has all that may still not judge it, why (`optional`: a bar some machines lack for a reason that is
no fault). The plugin skips a check whose needs the run lacks, with the reason derived here; every other check of
the run's tier is promised unless optional. So one source says both "cannot run here" and "must be judged here".

A check is judged when it passed or failed. A promised check that skipped was not judged: exit 4, the run did
not complete its proof. Not exit 1: no check found the machine at fault, so nothing is drained for it.
`-k` (or pytest arguments after `--`) is a person choosing to prove less: the promise shrinks to what the
selection holds, and the promised checks it left out are named (`left_out`), not held against the run.

Pure: plain data in, names out; no torch (the launcher and `stackproof verdict` decide without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stackproof.errors import ConfigError

HOST_KINDS = ("gpu", "cpu")
JUDGED = ("passed", "failed")
# The tiers a check belongs to. The fast tier (a Prolog's: identity, health, per-GPU) runs in every tier; the
# full tier adds the job's own work (collectives, training, compile); the soak runs only in the burn tier.
FAST = ("fast", "full", "burn")
FULL = ("full",)
SOAK = ("burn",)
TIERS = ("full", "fast", "burn")


@dataclasses.dataclass(frozen=True)
class World:
    """What a run has, as the ranks know it before any check: the judge's view of the job."""

    size: int = 1
    nodes: int = 1
    local_size: int = 1  # ranks on the smallest node (ranks are laid out node by node)
    gpu: bool = False  # GPU ranks (NCCL); else CPU ranks (gloo)

    @property
    def kind(self) -> str:
        return "gpu" if self.gpu else "cpu"

    @classmethod
    def from_record(cls, world: Mapping[str, Any]) -> World:
        """From report.json's `world`."""
        return cls(size=int(world.get("size", 1)), nodes=int(world.get("nodes", 1)),
                   local_size=int(world.get("local_world_size", 1)), gpu=world.get("backend") == "nccl")


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a check needs to be judged at all. A run without it skips the check, saying which need is unmet."""

    gpu: bool = False
    ranks: int = 1
    local_ranks: int = 1
    nodes: int = 1
    setting: str = ""  # a setting a person gives (its field in run/config.ValidateConfig): --spec, --baseline
    api: str = ""  # a torch attribute, dotted ("torch.distributed.fsdp.fully_shard"): absent from older torches

    def unmet(self, world: World, settings: Mapping[str, Any], has_api: Callable[[str], bool]) -> str | None:
        """Why this run cannot judge the check, or None when it can."""
        if self.gpu and not world.gpu:
            return "needs a CUDA GPU; this run is on CPU (gloo)"
        if world.size < self.ranks:
            return f"needs {self.ranks}+ ranks; this run has {world.size}"
        if world.local_size < self.local_ranks:
            return f"needs {self.local_ranks}+ ranks on one node; this run has {world.local_size} per node"
        if world.nodes < self.nodes:
            return f"needs {self.nodes}+ nodes; this run has {world.nodes}"
        if self.setting and not settings.get(self.setting):
            return f"needs --{self.setting.replace('_', '-')}: nothing asks for this check here"
        if self.api and not has_api(self.api):
            return f"needs {self.api}, which this torch does not have"
        return None

    def to_json(self) -> dict[str, Any]:
        default = Needs()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One check's declaration: `pytest.mark.check(tiers, needs, optional=..., optional_on=..., promised_by=...)`.
    What its failure means is not declared: its judge step's findings carry their own class (judge/findings.py
    Judged); a bare assertion is unclassified, an exception judge/exceptions.py's."""

    tiers: tuple[str, ...]
    needs: Needs = Needs()
    # Why a run that has the needs may still not judge it, on a healthy machine; empty: promised.
    optional: str = ""
    optional_on: tuple[str, ...] = HOST_KINDS  # the host kinds `optional` holds on
    promised_by: str = ""  # a setting that, given, makes an optional check promised (a person asked for its bar)

    def __post_init__(self) -> None:
        unknown = sorted({*self.tiers} - {*TIERS}) + sorted({*self.optional_on} - {*HOST_KINDS})
        if unknown or not self.tiers:
            raise ConfigError(f"a check declaration: expected tiers among {TIERS} and host kinds among "
                              f"{HOST_KINDS}, found {unknown or 'no tier'}; fix: declare it with "
                              "stackproof.judge.promise's FAST, FULL or SOAK")

    def promised(self, tier: str, world: World, settings: Mapping[str, Any],
                 has_api: Callable[[str], bool]) -> bool:
        """Whether a run of this tier on this world must judge the check (skipping it is then exit 4)."""
        optional = (self.optional and world.kind in self.optional_on
                    and not (self.promised_by and settings.get(self.promised_by)))
        return tier in self.tiers and self.needs.unmet(world, settings, has_api) is None and not optional

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"tiers": list(self.tiers), "needs": self.needs.to_json()}
        if self.optional:
            data.update(optional=self.optional, optional_on=list(self.optional_on))
        if self.promised_by:
            data["promised_by"] = self.promised_by
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Declaration:
        """A declaration as report.json holds it (an older report's `fails_as` is read past: nothing decides by it)."""
        return cls(tiers=tuple(data["tiers"]), needs=Needs(**data.get("needs", {})), optional=data.get("optional", ""),
                   optional_on=tuple(data.get("optional_on", HOST_KINDS)), promised_by=data.get("promised_by", ""))


def promised(declarations: Mapping[str, Declaration], tier: str, world: World, settings: Mapping[str, Any],
             has_api: Callable[[str], bool] = lambda api: True) -> list[str]:
    """The node ids a run of this tier on this world promises, in the suite's order."""
    return [nodeid for nodeid, declared in declarations.items()
            if declared.promised(tier, world, settings, has_api)]


def base_name(name: str) -> str:
    """collectives::all_reduce[sum-float32] -> collectives::all_reduce."""
    return name.split("[", 1)[0]


def unjudged(checks: Iterable[tuple[str, str, str, str]], promised_ids: Iterable[str]) -> list[str]:
    """The promised checks that reported without a judgement, each with why: `name: skipped: <reason>`.
    `checks`: (nodeid, name, outcome, message) of every check that reported. A promised check that never
    reported is the record's `not_run`, said before this."""
    promised_ids = set(promised_ids)
    return [f"{name}: skipped: {message.splitlines()[0] if message else 'no reason given'}"
            for nodeid, name, outcome, message in checks if nodeid in promised_ids and outcome not in JUDGED]


def left_out(promised_ids: Iterable[str], planned: Iterable[str], name: Callable[[str], str]) -> list[str]:
    """The promised checks the selection left out (said in the report; not held against the run), by name,
    a parametrized check once."""
    planned = set(planned)
    return list(dict.fromkeys(base_name(name(n)) for n in promised_ids if n not in planned))


def nothing_judged(checks: Iterable[tuple[str, str, str, str]]) -> str | None:
    """Why no check was judged (every one skipped), or None."""
    checks = list(checks)
    if not checks or any(outcome in JUDGED for _, _, outcome, _ in checks):
        return None
    _, name, _, message = checks[0]
    return f"every check skipped, e.g. {name}: {message.splitlines()[0] if message else 'no reason given'}"


def require_known_good(source: str, report: Mapping[str, Any], made: str) -> None:
    """A report a baseline or spec is made from must be of a complete run where every check passed: one made
    from failing runs would hold later runs to a broken machine. Anything else is refused (exit 2), naming the
    field that is not so: `complete` first (a run still going, or stopped, says OK nowhere it can be trusted)."""
    said = f"{report.get('verdict')!r} (exit code {report.get('exit_code')}: {report.get('message')})"
    if report.get("complete") is not True:
        field, expected, found = ("complete", "true (a run that finished and wrote its final verdict)",
                                  f"{report.get('complete')!r}: the run was still going or was stopped, verdict "
                                  + said)
    elif report.get("verdict") != "OK":
        field, expected, found = "verdict", "OK (a complete run where every check passed)", said
    elif report.get("exit_code") != 0:
        field, expected, found = "exit_code", "0 (every check ran and passed)", said
    else:
        return
    raise ConfigError(f"{source}: field '{field}': expected {expected}, found {found}; a {made} made from failing "
                      "runs (or unfinished ones) would hold later runs to a broken machine; fix: leave this report "
                      "out (or run the node again to the end)")
