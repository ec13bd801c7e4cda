"""What `stackproof healthcheck` and `stackproof act` do with a verdict: one checked dataclass, whose flags are
generated like validate's (stackproof/settings.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from stackproof.act import deadline as budget
from stackproof.act import history
from stackproof.act.breaker import limit_problem
from stackproof.judge.promise import TIERS
from stackproof.settings import Settings, at_least, node_name, not_blank, option, positive, seconds

SCHEDULERS = ("slurm", "kubernetes", "none")
# The re-proof that may return a node stackproof took out: deeper than the check that took it out (healthcheck's
# fast tier): every check of the full tier, then the burn soak (act/resume.py).
REPROOF_TIERS = ("full", "burn")


def tiers_problem(text: str) -> str | None:
    names = [t.strip() for t in str(text).split(",")]
    if not names or any(t not in TIERS for t in names) or len(set(names)) != len(names):
        return f"expected tiers from {', '.join(TIERS)}, comma-separated, each once, found {text!r}"
    return None
# The whole healthcheck, ended before slurmd kills it with the interpreter's start and exit around it left. A
# DaemonSet, which no such limit holds, passes its own --deadline.
DEADLINE_S = budget.SLURMD_LIMIT_S - budget.START_AND_EXIT_S


@dataclasses.dataclass(frozen=True)
class ActConfig(Settings):
    scheduler: str | None = option(None, "act through slurm (scontrol: drain a node with a hardware failure), "
                                         "kubernetes (kubectl: label every node pass/fail, annotate a failed one, "
                                         "taint one with a hardware failure) or none (say what would be done); "
                                         "the policy table: docs/act.md", choices=SCHEDULERS)
    node: str | None = option(None, "the node's name in the scheduler. healthcheck: this node's (default "
                                    "STACKPROOF_NODE_NAME, SLURMD_NODENAME, else the host name); act: act on this "
                                    "node only (default: every node of the report)", metavar="NAME",
                              check=node_name)
    act_timeout: float = option(30.0, "seconds each scontrol / sinfo / kubectl call may take", metavar="S",
                                check=seconds)
    max_nodes: int | None = option(None, "drain no node when more than N nodes of one run are to be drained (a "
                                         "failure that wide is more likely the image or the settings); default: "
                                         "no limit",
                                   metavar="N", check=at_least(1))
    max_drained: str = option("10%", "drain no node when the nodes stackproof has already drained (Slurm: its "
                                     "reason in sinfo -R) or tainted (Kubernetes), with this one, would be more "
                                     "than N, or than P% of the node's partitions / GPU node pool (rounded up): "
                                     "the failure is then reported and alerted on, not acted on",
                              metavar="N|P%", check=limit_problem)

    deadline: float = option(
        DEADLINE_S, f"seconds the whole healthcheck may take, validate and act together: validate's --run-timeout "
                    f"is cut to what is left once the NVML survey, stopping the ranks and --act-budget are kept (the "
                    f"default ends {budget.SLURMD_LIMIT_S - DEADLINE_S:g} s before slurmd kills a HealthCheckProgram "
                    f"at {budget.SLURMD_LIMIT_S:g} s)", metavar="S", check=positive)
    act_budget: float = option(12.0, "seconds of --deadline kept for acting (the breaker's count, the drain): each "
                                     "call at most --act-timeout and at most what is left of --deadline",
                               metavar="S", check=positive)
    breaker_lock: str | None = option(None, "Slurm: a file on storage every node of the pool shares (NFS with its "
                                            "lock service, Lustre, GPFS): the nodes take turns counting the "
                                            "drained nodes and draining themselves (flock, waited for at most "
                                            "--act-timeout), so many at once still drain at most --max-drained; "
                                            "without it the re-count after draining still resumes a node past "
                                            "the cap", metavar="FILE", check=not_blank)
    breaker_configmap: str = option("stackproof/stackproof-breaker",
                                    "Kubernetes: the ConfigMap (NAMESPACE/NAME) where a node claims its taint, "
                                    "replaced only at the resourceVersion it read (compare-and-swap), so many "
                                    "nodes at once still taint at most --max-drained",
                                    metavar="NAMESPACE/NAME", check=lambda v: None if v.count("/") == 1 and all(
                                        v.split("/")) else f"expected NAMESPACE/NAME, found {v!r}")

    reproof_tiers: str = option(",".join(REPROOF_TIERS),
                                "healthcheck on a node stackproof took out of service: the tiers it proves the node "
                                "with, in turn, before returning it (Slurm: state=resume; Kubernetes: its taint "
                                "removed); every one must pass. It must cover the tier that takes nodes out "
                                "(--tier) and should go deeper: the default is the full tier, then the burn soak",
                                metavar="TIER[,TIER]", check=lambda v: tiers_problem(v))
    reproof_foreground: bool = option(False, "run the re-proof inside this healthcheck and wait for it (a "
                                             "DaemonSet, a small re-proof); by default it runs detached, in its own "
                                             "session, one at a time per node (its log: reproof.log under "
                                             f"--reports), since slurmd kills a HealthCheckProgram at "
                                             f"{budget.SLURMD_LIMIT_S:g} s and the default re-proof takes minutes")
    lemon_window: float = option(history.LEMON_WINDOW_S,
                                 "a node taken out again within this many seconds of stackproof returning it "
                                 "(--lemon-count take-outs in all) stays out and needs service, whatever its next "
                                 "proof says (default 7 days)", metavar="S", check=seconds)
    lemon_count: int = option(history.LEMON_COUNT, "take-outs within --lemon-window, one after a return, that make "
                                                   "a node a lemon", metavar="N", check=at_least(2))

    skip_busy_gpus: bool = option(False, "check only the GPUs no process is using (NVML), saying which are "
                                         "skipped and expecting that many fewer; every GPU busy: check nothing, "
                                         "exit 0 (the DaemonSet, which holds no GPU, sets it)")

    # Flags of healthcheck alone (it chooses the GPUs a run checks): `act` refuses them, and its --help omits them.
    HEALTHCHECK_ONLY: ClassVar[tuple[str, ...]] = ("skip_busy_gpus",)

    def __post_init__(self) -> None:
        problems = self.field_problems()
        if self.scheduler is None:
            problems.append(f"--scheduler: expected the flag, with one of {', '.join(SCHEDULERS)}, found no "
                            "--scheduler; fix: pass --scheduler slurm or kubernetes to act, or --scheduler none to "
                            "only say what would be done")
        if not problems and (split := budget.problem(self.deadline, self.act_budget)):
            problems.append(split)
        self.refuse(problems, "stackproof act --help, stackproof healthcheck --help")

    @property
    def reproof(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.reproof_tiers.split(","))

    @property
    def lemon_rule(self) -> history.Rule:
        return history.Rule(self.lemon_window, self.lemon_count)

    @property
    def ranks_budget_s(self) -> float:
        """validate's --run-timeout under --deadline (healthcheck takes the smaller of the two)."""
        return budget.ranks_budget_s(self.deadline, self.act_budget)
