"""What `stackproof healthcheck` and `stackproof act` do with a verdict: one checked dataclass, whose flags are
generated the same way as validate's (stackproof/suite/config.py `option(...)`)."""

from __future__ import annotations

import argparse
import dataclasses

from stackproof.errors import ConfigError
from stackproof.suite.config import ValidateConfig, _at_least, _positive, flag_of, option

SCHEDULERS = ("slurm", "kubernetes", "none")


@dataclasses.dataclass(frozen=True)
class ActConfig:
    scheduler: str | None = option(None, "act through slurm (scontrol: drain a failed node), kubernetes (kubectl: "
                                         "label every node, annotate and taint a failed one) or none (say what "
                                         "would be done)", choices=SCHEDULERS)
    node: str | None = option(None, "the node's name in the scheduler. healthcheck: this node's (default "
                                    "STACKPROOF_NODE_NAME, SLURMD_NODENAME, else the host name); act: act on this "
                                    "node only (default: every node of the report)", metavar="NAME")
    act_timeout: float = option(30.0, "seconds each scontrol / kubectl call may take", metavar="S", check=_positive)
    max_nodes: int | None = option(None, "act on no node when more than N nodes of one run failed (a failure that "
                                         "wide is more likely the image or the settings); default: no limit",
                                   metavar="N", check=_at_least(1))

    def __post_init__(self) -> None:
        problems = [f"{flag_of(f)}: {message}" for f in dataclasses.fields(self)
                    if f.metadata.get("check") and (message := f.metadata["check"](getattr(self, f.name)))]
        if self.scheduler not in SCHEDULERS:
            problems.append(f"--scheduler: expected one of {', '.join(SCHEDULERS)}, found {self.scheduler!r}")
        if problems:
            raise ConfigError("; ".join(problems) + " (see: stackproof healthcheck --help)")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        # validate's generator, applied to these fields: one way to turn a field into a flag.
        ValidateConfig.add_arguments.__func__(cls, parser)  # type: ignore[attr-defined]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ActConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
