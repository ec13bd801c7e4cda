"""`stackproof act` and `stackproof healthcheck`: a run's verdict in, the scheduler's actions out. What acts and
what does not is decide.py's (with policy.py's table); the circuit breaker is breaker.py's; this prints each
action and performs it through the scheduler's tool, on every node even when one of them fails."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from stackproof.act import breaker, deadline, decide, hardware, kubernetes, policy, slurm, tool
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.measure.identity import node_name
from stackproof.measure.topology import NvmlUnavailable, nvidia_gpus_on_bus
from stackproof.report.record import Report
from stackproof.run import settle
from stackproof.run.config import ValidateConfig
from stackproof.tools import run_tool

SCHEDULERS = {"slurm": slurm, "kubernetes": kubernetes}  # "none": decide and say, act on nothing
# What makes a process a rank of someone else's job (torchrun's and srun's variables; run/dist.py reads
# them): healthcheck is this node's launcher, whatever started it (a Prolog inherits the job's, srun sets them).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
RANK_PREFIXES = ("TORCHELASTIC_",)
# A launch that chose the GPUs (run/visibility.py reads these): healthcheck then expects what it was given.
GPU_REQUESTS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE")
# healthcheck's exit codes: the scheduler's contract (docs/act.md). Non-zero only for a node to take out of service.
STAYS, TAKEN_OUT = 0, 1


def _say(out: IO[str]):
    return lambda text: print(f"# stackproof act: {text}", file=out, flush=True)


def act(decision: decide.Decision, settings: ActConfig, out: IO[str],
        clock: deadline.Deadline | None = None) -> tuple[decide.Decision, list[str]]:
    """Perform the decision through settings.scheduler's tool, saying each step on `out` ('#' lines): first the
    circuit breaker (drains the fleet cannot take are withheld), then every node's commands; a node whose
    command fails is said and the next node is still acted on. (the decision as done, the failures)."""
    scheduler = SCHEDULERS.get(settings.scheduler or "")
    say = _say(out)
    if clock is not None:  # healthcheck: every scheduler call within what is left of its --deadline
        settings = dataclasses.replace(settings, act_timeout=max(0.1, clock.call_timeout(settings.act_timeout)))
    if decision.drains and scheduler:
        decision = _circuit_breaker(decision, settings, scheduler, say)
    elif decision.drains:  # --scheduler none: no fleet to count, but the cap still holds for this run's nodes
        nodes = frozenset(a.node for a in decision.actions)
        decision = breaker.hold(decision, breaker.Fleet(nodes, frozenset()), settings.max_drained)
    say(decision.summary())
    failures = []
    for action in decision.actions:
        if action.failed:
            say(action.words())
        if action.action == policy.ALERT:
            print(f"stackproof ALERT: {action.words()}", file=sys.stderr, flush=True)
        for argv in scheduler.commands(action) if scheduler else []:
            say(f"run: {shlex.join(argv)}")
            try:
                run_tool(f"act on {action.node}", argv, timeout_s=settings.act_timeout, error=tool.ActError,
                         fix=f"{scheduler.FIX} (or raise --act-timeout)")
            except tool.ActError as err:
                failures.append(str(err))
                say(f"FAILED: {err}")
                break  # this node's later commands build on this one; the next node is tried
    if failures:
        say(f"{len(failures)} node action(s) failed: {'; '.join(f.split(':')[0] for f in failures)}")
    return decision, failures


def _circuit_breaker(decision: decide.Decision, settings: ActConfig, scheduler, say) -> decide.Decision:
    targets = {a.node for a in decision.drains}
    try:
        out = run_tool("count the nodes stackproof has drained", scheduler.FLEET, timeout_s=settings.act_timeout,
                       error=tool.ActError, fix=f"{scheduler.FIX} (or raise --act-timeout)")
        fleet = scheduler.fleet(out, targets)
    except (tool.ActError, ValueError, KeyError, TypeError, AttributeError) as err:
        return decision.hold_drains(f"could not count the nodes already out of service, so --max-drained "
                                    f"cannot be kept ({err})")
    say(f"circuit breaker: {len(fleet.drained)} of {len(fleet.pool)} nodes out of service by stackproof"
        f"{' (' + ', '.join(sorted(fleet.drained)) + ')' if fleet.drained else ''}; --max-drained "
        f"{settings.max_drained} allows {breaker.limit(settings.max_drained, len(fleet.pool))}")
    return breaker.hold(decision, fleet, settings.max_drained)


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
    return tool.ActError.exit_code if failures else Exit.OK


def bad_input(err: ConfigError, out: IO[str]) -> int:
    """Bad input: nothing ran, so there is nothing to act on (decide.py's policy); the node stays in service."""
    print(f"stackproof: {err}", file=out, flush=True)
    print(f"# stackproof act: not acted on: exit code {int(Exit.USAGE)} ({Exit.USAGE.meaning}) says nothing "
          "about the machine", file=out, flush=True)
    print(f"# stackproof healthcheck: validate exit {int(Exit.USAGE)}; this node stays in service; exit {STAYS}",
          file=out, flush=True)
    return STAYS


def as_launcher(env: dict[str, str] | os._Environ = os.environ) -> list[str]:
    """Forget the rank variables inherited from a job or srun (healthcheck launches its own ranks); the names."""
    names = [k for k in list(env) if k in RANK_VARIABLES or k.startswith(RANK_PREFIXES)]
    for name in names:
        del env[name]
    return names


@dataclasses.dataclass(frozen=True)
class Plan:
    """What healthcheck expects of this node, before anything runs: the settings its ranks get, and why."""
    node: str
    validate: ValidateConfig
    said: tuple[str, ...] = ()
    nothing_to_check: bool = False


def plan(validate_settings: ValidateConfig, settings: ActConfig, env: dict[str, str] | os._Environ,
         bus: list[str] | None, use: list[hardware.GpuUse] | str | None = None) -> Plan:
    """A pure function of the flags, the environment, the PCI bus (`bus`: NVIDIA GPUs there) and, with
    --skip-busy-gpus, NVML's GPU use (`use`: None when not asked, a string when NVML could not say)."""
    said = []
    # One name for this node: --node, else --node-name / STACKPROOF_NODE_NAME, else the scheduler's, else the host's.
    node = settings.node or validate_settings.node_name or node_name(env)
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
    """Validate this node, then act on what the run found. The scheduler's contract: exit 1 only when this node
    is taken out of service (drained / tainted, or would be with --scheduler none); every other outcome (a pass,
    an alert, a withheld drain, a tool error, bad input) exits 0 with the reason on `out`."""
    from stackproof.run.launcher import launch

    clock = deadline.Deadline.start(settings.deadline)
    say = lambda text: print(f"# stackproof healthcheck: {text}", file=out, flush=True)  # noqa: E731
    forgot = as_launcher()
    if forgot:
        say(f"runs as this node's launcher, not as a rank: ignoring {', '.join(forgot)}")
    use: list[hardware.GpuUse] | str | None = None
    if settings.skip_busy_gpus:
        try:
            use = hardware.gpu_use() or "NVML cannot answer"
        except NvmlUnavailable as err:
            use = str(err)
    the_plan = plan(validate_settings, settings, os.environ, nvidia_gpus_on_bus(validate_settings.pci_devices), use)
    for line in the_plan.said:
        say(line)
    if the_plan.nothing_to_check:
        return _contract("validate not run", None, out)
    run_settings = _writable_reports(deadline.fit(the_plan.validate, settings), say)
    started = time.time()
    try:
        record = launch(run_settings)
    except ConfigError as err:
        return bad_input(err, out)
    outcome = f"validate exit {int(record.exit_code)} ({record.exit_code.meaning})"
    decision = decide.decide(record, not_before=started, max_nodes=settings.max_nodes, node=the_plan.node)
    done, _failures = act(decision, settings, out, clock)
    return _contract(outcome, done, out, dry_run=settings.scheduler not in SCHEDULERS)


def _writable_reports(validate_settings: ValidateConfig, say) -> ValidateConfig:
    """A reports folder that cannot take the run (read-only, full) must not keep a broken node in service: the
    run goes to a private folder instead, and says so."""
    problem = settle.unwritable(validate_settings.reports_dir)
    if problem is None:
        return validate_settings
    private = tempfile.mkdtemp(prefix="stackproof-healthcheck-")
    say(f"the reports folder could not be written ({problem}): this run's report is in {private}; fix: make "
        f"--reports {validate_settings.reports} writable, with room")
    return dataclasses.replace(validate_settings, reports=private)


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
