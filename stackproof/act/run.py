"""`stackproof act` and `stackproof healthcheck`: a run's verdict in, the scheduler's actions out. What acts and
what does not is decide.py's (with policy.py's table); the circuit breaker is breaker.py's; this prints each
action and performs it through the scheduler's tool, on every node even when one of them fails."""

from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
import sys
from typing import IO

from stackproof.act import breaker, decide, hardware, kubernetes, policy, slurm, tool
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError, Exit
from stackproof.measure.identity import NODE_NAME_ENV, node_name
from stackproof.measure.topology import NvmlUnavailable, nvidia_gpus_on_bus
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


def act(decision: decide.Decision, settings: ActConfig, out: IO[str]) -> tuple[decide.Decision, list[str]]:
    """Perform the decision through settings.scheduler's tool, saying each step on `out` ('#' lines): first the
    circuit breaker (drains the fleet cannot take are withheld), then every node's commands; a node whose
    command fails is said and the next node is still acted on. (the decision as done, the failures)."""
    scheduler = SCHEDULERS.get(settings.scheduler or "")
    say = _say(out)
    if decision.drains and scheduler:
        decision = _circuit_breaker(decision, settings, scheduler, say)
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


def act_on_reports(reports_dir, settings: ActConfig, out: IO[str]) -> int:
    """`stackproof act --reports DIR`: a finished (multi-node) run. Exit 0 when done as the policy says (acting or
    not); 2 when the report cannot be read or any node's action failed (every node is still tried)."""
    decision = decide.decide(decide.load(reports_dir), max_nodes=settings.max_nodes, node=settings.node)
    if settings.node:
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


def healthcheck(validate_settings: ValidateConfig, settings: ActConfig, out: IO[str]) -> int:
    """Validate this node, then act on what the run found. The scheduler's contract: exit 1 only when this node
    is taken out of service (drained / tainted, or would be with --scheduler none); every other outcome (a pass,
    an alert, a withheld drain, a tool error, bad input) exits 0 with the reason on `out`."""
    from stackproof.run.launcher import validate

    forgot = as_launcher()
    if forgot:
        print(f"# stackproof healthcheck: runs as this node's launcher, not as a rank: ignoring {', '.join(forgot)}",
              file=out, flush=True)
    if settings.node:
        # The ranks are other processes: they learn the node's scheduler name the way pods do (identity.py).
        os.environ[NODE_NAME_ENV[0]] = settings.node
    on_pci = len(nvidia_gpus_on_bus() or [])
    if on_pci and validate_settings.expect_gpus is None and not any(os.environ.get(k) for k in GPU_REQUESTS):
        # Nothing says how many GPUs this node should show: its PCI bus does (else a node whose driver lost
        # every GPU would pass on CPU).
        print(f"# stackproof healthcheck: --expect-gpus {on_pci}, the NVIDIA GPUs on the PCI bus", file=out,
              flush=True)
        validate_settings = dataclasses.replace(validate_settings, expect_gpus=on_pci)
    if settings.skip_busy_gpus:
        validate_settings = _leave_busy_gpus(validate_settings, out)
        if validate_settings is None:
            return _contract("validate not run", None, out)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    try:
        code = validate(validate_settings)
    except ConfigError as err:
        return bad_input(err, out)
    outcome = f"validate exit {int(code)} ({Exit(code).meaning if code in iter(Exit) else 'unknown'})"
    try:
        report = decide.load(validate_settings.reports_dir)
    except ConfigError as err:
        print(f"# stackproof act: not acted on: {err}", file=out, flush=True)
        return _contract(outcome, None, out)
    decision = decide.decide(report, exit_code=int(code), not_before=started, max_nodes=settings.max_nodes,
                             node=settings.node or node_name(), gpus_on_pci=on_pci)
    done, _failures = act(decision, settings, out)
    return _contract(outcome, done, out, dry_run=settings.scheduler not in SCHEDULERS)


def _leave_busy_gpus(validate_settings: ValidateConfig, out: IO[str]) -> ValidateConfig | None:
    """--skip-busy-gpus: the settings for the idle GPUs only (CUDA_VISIBLE_DEVICES, --expect-gpus), or None when
    every GPU is in use."""
    say = lambda text: print(f"# stackproof healthcheck: {text}", file=out, flush=True)  # noqa: E731
    try:
        use = hardware.gpu_use()
    except NvmlUnavailable as err:
        use = None
        say(f"{err}: no GPU skipped")
    if use is None:
        return validate_settings
    plan = hardware.idle_plan(use, validate_settings.expect_gpus)
    if plan.words:
        say(plan.words)
    if plan.nothing_idle:
        return None
    if plan.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    return dataclasses.replace(validate_settings, expect_gpus=plan.expect_gpus, skipped_gpus=plan.skipped)


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
