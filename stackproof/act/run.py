"""`stackproof act` and `stackproof healthcheck`: a run's verdict in, the scheduler's actions out. What acts and
what does not is decide.py's (with policy.py's table); the circuit breaker is breaker.py's; this prints each
action and performs it through the scheduler's tool, on every node even when one of them fails."""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from stackproof import environment
from stackproof.act import breaker, deadline, decide, hardware, kubernetes, resume, slurm
from stackproof.act import lock as breaker_lock
from stackproof.act.commands import SCHEDULERS, run_commands, say_to, writable_reports
from stackproof.act.config import ActConfig
from stackproof.errors import ActError, ConfigError, Exit, Healthcheck
from stackproof.judge import policy
from stackproof.measure import watermark
from stackproof.measure.identity import NODE_NAME_ENV, node_name
from stackproof.measure.topology import SURVEY_DEADLINE_S, NvmlUnavailable, nvidia_gpus_on_bus
from stackproof.report import folders
from stackproof.report.record import Report
from stackproof.run.config import ValidateConfig
from stackproof.settings import node_name as settings_node_name
from stackproof.tools import run_tool

# What makes a process a rank of someone else's job (torchrun's and srun's variables; run/dist.py reads
# them): healthcheck is this node's launcher, whatever started it (a Prolog inherits the job's, srun sets them).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
RANK_PREFIXES = ("TORCHELASTIC_",)
# A launch that chose the GPUs (run/visibility.py reads these): healthcheck then expects what it was given.
GPU_REQUESTS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE")
# healthcheck's exit codes: the scheduler's contract (errors.Healthcheck, docs/act.md).
STAYS, TAKEN_OUT = Healthcheck.STAYS, Healthcheck.TAKEN_OUT
# Slurm's re-count after draining waits this long, so that slurmctld's stamp of the drain (whole seconds) is over.
RECOUNT_SETTLE_S = 2.0
CLAIM_ATTEMPTS = 8  # Kubernetes: compare-and-swap tries before the drain is withheld



def act(decision: decide.Decision, settings: ActConfig, out: IO[str], clock: deadline.Deadline | None = None,
        evidence: Path | None = None) -> tuple[decide.Decision, list[str]]:
    """Perform the decision through settings.scheduler's tool, saying each step on `out` ('#' lines): first the
    circuit breaker (drains the fleet cannot take are withheld), then every node's commands; a node whose
    command fails is said and the next node is still acted on. A run that acted on nothing labels the node
    (Kubernetes: verdict=incomplete). `evidence`: the reports root of a --keep-runs run (its `last-acted` link
    is moved to the run when a drain was done or withheld). (the decision as done, the failures)."""
    scheduler = SCHEDULERS.get(settings.scheduler or "")
    say = say_to(out)
    if clock is not None:  # healthcheck: every scheduler call within what is left of its --deadline when it starts
        settings = _Timed(settings, clock)  # type: ignore[assignment]
    failures: list[str] = []
    lock = Path(settings.breaker_lock) if scheduler is slurm and decision.drains and settings.breaker_lock else None
    try:
        with breaker_lock.held(lock, settings.act_timeout) as waited:
            if lock is not None:
                say(f"circuit breaker: holding {lock} (waited {waited:.1f} s): one node at a time counts and drains")
            decision = _act_within_breaker(decision, settings, scheduler, say, failures)
    except ActError as err:  # the lock could not be had: nothing was counted, so nothing is drained
        decision = decision.hold_drains(f"the circuit breaker's lock was not had, so --max-drained cannot be "
                                        f"kept ({err})")
        decision = _act_within_breaker(decision, settings, scheduler, say, failures)
    if failures:
        say(f"{len(failures)} node action(s) failed: {'; '.join(f.split(':')[0] for f in failures)}")
    if evidence is not None and (decision.drains or any(a.held for a in decision.actions)):
        run = folders.current(evidence)
        folders.link(evidence, folders.LAST_ACTED, run)
        say(f"evidence: {evidence / folders.LAST_ACTED} -> {run}")
    return decision, failures


class _Timed:
    """The settings, with --act-timeout read at each call: what is left of the deadline when that call starts, if
    less (so the calls together, the re-count's wait included, end within the deadline)."""

    def __init__(self, settings: ActConfig, clock: deadline.Deadline):
        self._settings, self.clock = settings, clock

    def __getattr__(self, name: str):
        return getattr(self._settings, name)

    @property
    def act_timeout(self) -> float:
        return max(0.1, self.clock.call_timeout(self._settings.act_timeout))


def _act_within_breaker(decision: decide.Decision, settings: ActConfig, scheduler, say,
                        failures: list[str]) -> decide.Decision:
    if decision.drains and scheduler:
        decision = _circuit_breaker(decision, settings, scheduler, say)
    elif decision.drains:  # --scheduler none: no fleet to count, but the cap still holds for this run's nodes
        nodes = frozenset(a.node for a in decision.actions)
        decision = breaker.hold(decision, breaker.Fleet(nodes, frozenset()), settings.max_drained)
    say(decision.summary())
    if scheduler is kubernetes and not decision.actions and settings.node:
        # Acted on nothing (the run did not complete, bad input, a stale report): an old `pass` must not stay.
        run_commands(settings.node, kubernetes.incomplete_commands(
            settings.node, decide.fit(f"{decide.PREFIX} not judged: {decision.withheld}")), settings, say, failures)
    for action in decision.actions:
        if action.failed:
            say(action.words())
        if action.action == policy.ALERT:
            print(f"stackproof ALERT: {action.words()}", file=sys.stderr, flush=True)
        run_commands(action.node, scheduler.commands(action) if scheduler else [], settings, say, failures)
    if scheduler is slurm and decision.drains:
        decision = _recount(decision, settings, say, failures)
    return decision



def _count(settings: ActConfig, scheduler, targets: set[str]) -> breaker.Fleet:
    out = run_tool("count the nodes stackproof has drained", scheduler.FLEET, timeout_s=settings.act_timeout,
                   error=ActError, fix=f"{scheduler.FIX} (or raise --act-timeout)")
    return scheduler.fleet(out, targets)


def _circuit_breaker(decision: decide.Decision, settings: ActConfig, scheduler, say) -> decide.Decision:
    targets = {a.node for a in decision.drains}
    try:
        fleet = _count(settings, scheduler, targets)
    except (ActError, ValueError, KeyError, TypeError, AttributeError) as err:
        return decision.hold_drains(f"could not count the nodes already out of service, so --max-drained "
                                    f"cannot be kept ({err})")
    say(f"circuit breaker: {len(fleet.drained)} of {len(fleet.pool)} nodes out of service by stackproof"
        f"{' (' + ', '.join(sorted(fleet.drained)) + ')' if fleet.drained else ''}; --max-drained "
        f"{settings.max_drained} allows {breaker.limit(settings.max_drained, len(fleet.pool))}")
    decision = breaker.hold(decision, fleet, settings.max_drained)
    if scheduler is kubernetes:
        for action in decision.drains:
            granted, why = _claim(action.node, fleet, settings, say)
            if not granted:
                decision = decision.hold_drains(why, {action.node})
    return decision


def _claim(node: str, fleet: breaker.Fleet, settings: ActConfig, say) -> tuple[bool, str]:
    """Kubernetes: claim the taint in the breaker's ConfigMap, compare-and-swap on its resourceVersion; a lost
    race reads again (the taints too: the winner may have tainted by now). (granted, why not)."""
    configmap = settings.breaker_configmap
    for attempt in range(CLAIM_ATTEMPTS):
        try:
            if attempt:
                fleet = _count(settings, kubernetes, {node})
            try:
                read = run_tool("read the breaker's claims", kubernetes.claim_read(configmap),
                                timeout_s=settings.act_timeout, error=ActError, fix=kubernetes.FIX)
            except ActError as err:
                if kubernetes.ABSENT not in str(err):
                    raise
                read = None
            claims, current = kubernetes.claims_of(read)
            decided = breaker.claim(claims, fleet, node, settings.max_drained, time.time())
            if not decided.granted or decided.data is None:
                return decided.granted, decided.words
            argv, body = kubernetes.claim_write(configmap, current, decided.data)
            try:
                run_tool("claim the taint", argv, timeout_s=settings.act_timeout, error=ActError,
                         fix=kubernetes.FIX, input=body)
            except ActError as err:
                if any(words in str(err) for words in kubernetes.LOST_RACE):
                    say(f"circuit breaker: {configmap} changed since it was read; reading it again")
                    time.sleep(random.uniform(0.05, 0.5))
                    continue
                raise
            say(f"circuit breaker: {node} {decided.words} in {configmap}")
            return True, ""
        except (ActError, ValueError, KeyError, TypeError) as err:
            return False, f"could not claim the taint in {configmap}, so --max-drained cannot be kept ({err})"
    return False, f"{CLAIM_ATTEMPTS} tries to claim the taint in {configmap} lost to other nodes"


def _recount(decision: decide.Decision, settings: ActConfig, say, failures: list[str]) -> decide.Decision:
    """Slurm, after draining: count again once slurmctld's stamp of these drains is a second old (so every drain
    stamped with or before them is seen), in slurmctld's order; a drain past --max-drained is undone."""
    clock = getattr(settings, "clock", None)
    time.sleep(RECOUNT_SETTLE_S if clock is None else clock.call_timeout(RECOUNT_SETTLE_S))
    drained = {a.node for a in decision.drains}
    try:
        fleet = _count(settings, slurm, drained)
    except (ActError, ValueError) as err:
        say(f"circuit breaker: the re-count after draining failed ({err}); the drain stands")
        return decision
    past = sorted(n for n in drained if n in fleet.drained and not breaker.keeps(fleet, n, settings.max_drained))
    if not past:
        say(f"circuit breaker: re-count: {len(fleet.drained)} of {len(fleet.pool)} out of service; within "
            f"--max-drained {settings.max_drained}")
        return decision
    why = (f"the re-count after draining found {len(fleet.drained)} of {len(fleet.pool)} nodes out of service, "
           f"{', '.join(past)} past --max-drained {settings.max_drained} in the order slurmctld took the drains "
           "(many nodes failing at once: more likely the image, the settings or the site); resumed")
    undone = {n for n in past if run_commands(n, [slurm.resume(n)], settings, say, failures)}
    return decision.hold_drains(why, undone) if undone else decision


def act_on_reports(reports_dir: Path, settings: ActConfig, out: IO[str]) -> int:
    """`stackproof act --reports DIR`: a finished (multi-node) run. Exit 0 when done as the policy says (acting or
    not); 2 when the record cannot be read (another schema, another shape), --node names no node of it, or any
    node's action failed (every node is still tried)."""
    record = Report.read(reports_dir)
    decision = decide.decide(record, max_nodes=settings.max_nodes)
    if settings.node:
        known = [a.node for a in decision.actions] or list(dict.fromkeys(r["node"] for r in record.ranks))
        if settings.node not in known:
            raise ConfigError(f"--node {settings.node}: expected a node of the run in {reports_dir}, found only "
                              f"{', '.join(known) or 'no node'}; fix: pass one of those names, or leave --node out "
                              "to act on every node of the report")
        decision = dataclasses.replace(decision, actions=tuple(a for a in decision.actions if a.node == settings.node))
    _, failures = act(decision, settings, out)
    return ActError.exit_code if failures else Exit.OK


def bad_input(err: ConfigError, out: IO[str]) -> int:
    """Bad input: nothing ran, so there is nothing to act on (decide.py's policy); the node stays in service."""
    print(f"stackproof: {err}", file=out, flush=True)
    print(f"# stackproof act: not acted on: exit code {int(Exit.USAGE)} ({Exit.USAGE.meaning}) says nothing "
          "about the machine", file=out, flush=True)
    print(f"# stackproof healthcheck: validate exit {int(Exit.USAGE)}; this node stays in service; exit {STAYS}",
          file=out, flush=True)
    return STAYS


def as_launcher(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment healthcheck launches its own ranks in: `env` less the rank variables inherited from a job
    or srun; and their names."""
    names = [k for k in env if k in RANK_VARIABLES or k.startswith(RANK_PREFIXES)]
    return {k: v for k, v in env.items() if k not in names}, names


@dataclasses.dataclass(frozen=True)
class Plan:
    """What healthcheck expects of this node, before anything runs: the settings its ranks get, and why."""
    node: str
    validate: ValidateConfig
    said: tuple[str, ...] = ()
    nothing_to_check: bool = False


def plan(validate_settings: ValidateConfig, settings: ActConfig, env: Mapping[str, str],
         bus: list[str] | None, use: list[hardware.GpuUse] | str | None = None) -> Plan:
    """A pure function of the flags, the environment, the PCI bus (`bus`: NVIDIA GPUs there) and, with
    --skip-busy-gpus, NVML's GPU use (`use`: None when not asked, a string when NVML could not say)."""
    said = []
    # One name for this node: --node, else --node-name / STACKPROOF_NODE_NAME, else the scheduler's, else the host's.
    node = settings.node or validate_settings.node_name or node_name(env)
    unfit = None if settings.node or validate_settings.node_name else settings_node_name(node)
    if unfit:  # the scheduler's variable (or the host name) said it, not a flag: name where it came from
        source = next((f"{name}={env[name]!r}" for name in NODE_NAME_ENV if env.get(name)), "the host name")
        raise ConfigError(f"{source}: {unfit}; fix: pass --node NAME (the node's name in the scheduler)")
    changes: dict[str, object] = {"node_name": node}
    # How many GPUs to expect is run/visibility.py's (the flag, the scheduler, the launch, else the PCI bus); only
    # --skip-busy-gpus takes the busy ones off what the bus says.
    expect = validate_settings.expect_gpus
    if expect is None and bus and not any(env.get(k) for k in GPU_REQUESTS):
        expect = len(bus)
    if isinstance(use, str):
        said.append(f"--skip-busy-gpus: {use}; no GPU skipped")
    elif use is not None:
        idle = hardware.idle_plan(use, expect)
        if idle.words:
            said.append(idle.words)
        if idle.nothing_idle:
            return Plan(node, validate_settings, tuple(said), nothing_to_check=True)
        if idle.cuda_visible_devices is not None:
            changes["visible_devices"] = idle.cuda_visible_devices
            changes["expect_gpus"] = idle.expect_gpus
            changes["skipped_gpus"] = idle.skipped
    return Plan(node, dataclasses.replace(validate_settings, **changes), tuple(said))


def healthcheck(validate_settings: ValidateConfig, settings: ActConfig, out: IO[str]) -> int:
    """Validate this node, then act on what the run found. The scheduler's contract: exit TAKEN_OUT only when this
    node is taken out of service (drained / tainted, or would be with --scheduler none); every other outcome (a pass,
    an alert, a withheld drain, a tool error, bad input, another healthcheck already checking this node) exits 0
    with the reason on `out`. The whole command holds the reports folder (act/lock.py's only_one): two healthchecks
    on one node (the hourly check and a job's Prolog) would each see the other's ranks on the GPUs."""
    clock = deadline.Deadline.start(settings.deadline)  # every blocking call below takes at most what it leaves
    say = lambda text: print(f"# stackproof healthcheck: {text}", file=out, flush=True)  # noqa: E731
    env, forgot = as_launcher(environment.current())
    if forgot:
        say(f"runs as this node's launcher, not as a rank: ignoring {', '.join(forgot)}")
    with breaker_lock.only_one(validate_settings.reports_dir) as holder:
        if holder:
            say(f"another healthcheck is checking this node ({holder}): this one judges nothing and acts on nothing")
            return _contract("validate not run (a check is already running)", None, out)
        return _healthcheck(validate_settings, settings, out, clock, say, env)


def _healthcheck(validate_settings: ValidateConfig, settings: ActConfig, out: IO[str], clock: deadline.Deadline,
                 say, env: Mapping[str, str]) -> int:
    from stackproof.run.launcher import launch

    use: list[hardware.GpuUse] | str | None = None
    if settings.skip_busy_gpus:
        try:
            use = hardware.gpu_use(clock.call_timeout(SURVEY_DEADLINE_S)) or "NVML cannot answer"
        except NvmlUnavailable as err:
            use = str(err)
    the_plan = plan(validate_settings, settings, env, nvidia_gpus_on_bus(validate_settings.pci_devices), use)
    for line in the_plan.said:
        say(line)
    if the_plan.nothing_to_check:
        return _contract("validate not run", None, out)
    # Back in service only by proof (act/resume.py): a node stackproof took out is re-proved, one out for any
    # other reason is left alone.
    found = resume.standing(the_plan.node, settings.scheduler, clock.call_timeout(settings.act_timeout))
    if found.state == resume.OTHER:
        say(f"this node is {found.words()}: not stackproof's to check or return; left as it is")
        return _contract("validate not run", None, out)
    if found.state == resume.OURS:
        try:
            return resume.reprove(the_plan.validate, settings, the_plan.node, found, out, env)
        except ConfigError as err:
            return bad_input(err, out)
    run_settings = writable_reports(deadline.fit(the_plan.validate, settings), say)
    looks = watermark.snapshot(run_settings.health_state_dir, the_plan.node)  # the evidence's last looks
    started = time.time()
    try:  # the ranks end in time to be stopped, and act keeps its budget after them
        record = launch(run_settings, clock.before(deadline.STOP_S + settings.act_budget), env)
    except ConfigError as err:
        return bad_input(err, out)
    outcome = f"validate exit {int(record.exit_code)} ({record.exit_code.meaning})"
    decision = decide.decide(record, not_before=started, max_nodes=settings.max_nodes, node=the_plan.node)
    kept = run_settings.reports_dir if run_settings.keep_runs else None  # its last-acted link (report/folders.py)
    done, _failures = act(decision, settings, out, clock, evidence=kept)
    keep_evidence(done, looks, run_settings.health_state_dir, the_plan.node, say)
    resume.after_check(done, the_plan.node, found, run_settings, settings,
                       resume.run_id(run_settings.reports_dir, run_settings.keep_runs, started), say)
    return _contract(outcome, done, out, dry_run=settings.scheduler not in SCHEDULERS)


def keep_evidence(done: decide.Decision, looks: dict[Path, bytes], state_dir: Path, node: str, say) -> None:
    """A drain the policy asked for and that was withheld (the circuit breaker, --max-nodes), or a run acted on for
    nothing: the GPUs' last looks go back to before this run (measure/watermark.py), so the next run judges the
    same XIDs and counter growth again instead of starting after them."""
    held = [a for a in done.actions if a.held]
    if not held and not done.withheld:
        return
    problem = watermark.restore(looks, state_dir, node)
    said = f"could not be kept ({problem})" if problem else "kept for the next run (the last looks rewound)"
    say(f"evidence since the last look {said}: {'the drain was withheld' if held else 'nothing was acted on'}")



def _contract(outcome: str, done: decide.Decision | None, out: IO[str], dry_run: bool = False) -> int:
    drained = [a.node for a in done.drains] if done else []
    if drained:
        words = f"{'would be taken (--scheduler none)' if dry_run else 'taken'} out of service ({', '.join(drained)})"
        code = TAKEN_OUT
    else:
        held = [a for a in (done.to_act if done else ()) if a.held]
        words = "stays in service" + (f" (drain withheld: {held[0].held})" if held else "")
        code = STAYS
    print(f"# stackproof healthcheck: {outcome}; this node {words}; exit {code}", file=out, flush=True)
    return code
