"""Back in service only by proof. A node stackproof took out (Slurm: drained with a `stackproof:` reason;
Kubernetes: its stackproof.io/unhealthy taint) is returned only by stackproof, after a re-proof deeper than the
check that took it out (--reproof-tiers, the full tier then the burn soak by default), run on the node while it
is out of service: slurmd runs its HealthCheckProgram on drained nodes too (HealthCheckNodeState=ANY), and the
DaemonSet's pod tolerates its own taint.

  - a pass returns it: Slurm `state=resume` and the node's Comment naming the run; Kubernetes the taint removed
    and the annotation stackproof.io/returned-by naming the run;
  - a failure keeps it out with the new evidence (the reason / annotation replaced by the re-proof's);
  - a lemon (act/history.py: taken out again soon after its return) stays out, needing service, whatever the
    re-proof says;
  - a node out of service for any other reason (an operator's drain, Slurm's own) is never touched: the
    healthcheck says so and checks nothing.

`standing_of_*` and `plan` are pure; `standing` and `reprove` ask the scheduler and run the proof."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from stackproof.act import commands as calls
from stackproof.act import decide, history, kubernetes, lock
from stackproof.errors import ActError, ConfigError, Exit, Healthcheck
from stackproof.judge import policy
from stackproof.judge.promise import FAST, FULL, SOAK, TIERS

IN_SERVICE, OURS, OTHER, UNKNOWN = "in-service", "ours", "other", "unknown"
LOCK_FILE = "reproof.lock"  # in the node's state folder: one re-proof at a time
LOG_FILE = "reproof.log"  # under --reports: a detached re-proof's output
RETURNED_ANNOTATION = f"{kubernetes.DOMAIN}/returned-by"
SERVICE_ANNOTATION = f"{kubernetes.DOMAIN}/needs-service"
# Slurm states a node is out of service in (scontrol's State, its flags joined by '+', lower case).
_SLURM_OUT = ("drain", "down", "fail", "maint", "reboot", "future", "unknown")
# Which declared kinds of check each tier runs (judge/promise.py: a FAST check runs in every tier, FULL in the
# full tier, SOAK in burn): a re-proof must cover the tier that takes nodes out.
_DECLARED = {"fast": FAST, "full": FULL, "soak": SOAK}
TIER_CHECKS = {tier: {kind for kind, tiers in _DECLARED.items() if tier in tiers} for tier in TIERS}


@dataclasses.dataclass(frozen=True)
class Standing:
    state: str  # IN_SERVICE, OURS, OTHER, UNKNOWN
    reason: str = ""  # the scheduler's reason (Slurm) or stackproof's annotation / the other taints (Kubernetes)

    def words(self) -> str:
        return {IN_SERVICE: "in service", OURS: f"out of service by stackproof ({self.reason})",
                OTHER: f"out of service for another reason ({self.reason})",
                UNKNOWN: f"its standing unknown ({self.reason})"}[self.state]


def slurm_query(node: str) -> list[str]:
    # scontrol, not sinfo: the one node, and the circuit breaker's count stays the first sinfo a check makes.
    return ["scontrol", "show", "node", node, "--oneliner"]


_STATE = re.compile(r"\bState=(\S+)")
# Slurm prints the reason, then who set it and when: "Reason=<free text> [root@2026-12-03T09:30:11]".
_REASON = re.compile(r"\bReason=(.*?) \[[^\]\s]*@[^\]\s]*\]")


def standing_of_slurm(scontrol: str, node: str) -> Standing:
    """slurm_query's output -> the node's standing. Ours: drained (or draining) with stackproof's reason prefix."""
    if not re.search(rf"\bNodeName={re.escape(node)}\b", scontrol) or not (state := _STATE.search(scontrol)):
        return Standing(UNKNOWN, f"scontrol does not show {node}")
    flags = state.group(1).rstrip("*~#!%$@^-").lower()
    reason = _REASON.search(scontrol)
    words = reason.group(1).strip() if reason else ""
    if not any(word in flags for word in _SLURM_OUT):
        return Standing(IN_SERVICE)
    if "drain" in flags and words.startswith(decide.PREFIX):
        return Standing(OURS, words)
    return Standing(OTHER, f"{flags}: {words}" if words else flags)


def kubernetes_query(node: str) -> list[str]:
    return ["kubectl", "get", "node", node, "-o", "json"]


def standing_of_kubernetes(node_json: str) -> Standing:
    """A Node object -> its standing. Ours: it carries stackproof's taint (a cordon or other taints beside it
    stay: only ours is ever removed). Other: cordoned, or tainted NoSchedule/NoExecute by someone else."""
    obj = json.loads(node_json)
    spec = obj.get("spec") or {}
    taints = spec.get("taints") or []
    if any(t.get("key") == kubernetes.TAINT_KEY for t in taints):
        reason = ((obj.get("metadata") or {}).get("annotations") or {}).get(kubernetes.CHECK_ANNOTATION, "")
        return Standing(OURS, reason or kubernetes.TAINT)
    others = [f"{t.get('key')}:{t.get('effect')}" for t in taints if t.get("effect") in ("NoSchedule", "NoExecute")
              and not str(t.get("key", "")).startswith("node.kubernetes.io/unschedulable")]
    if spec.get("unschedulable") or others:
        return Standing(OTHER, ", ".join((["cordoned"] if spec.get("unschedulable") else []) + others))
    return Standing(IN_SERVICE)


def covers(tiers: tuple[str, ...], tier: str) -> tuple[bool, bool]:
    """(the re-proof runs every kind of check `tier` runs, and more)."""
    proof = set().union(*(TIER_CHECKS[t] for t in tiers))
    return proof >= TIER_CHECKS[tier], proof > TIER_CHECKS[tier]


def reproof_problem(tiers: tuple[str, ...], tier: str) -> str | None:
    if not covers(tiers, tier)[0]:
        return (f"--reproof-tiers {','.join(tiers)}: expected a proof at least as deep as the one that takes nodes "
                f"out (--tier {tier}), found one that leaves some of its checks out; fix: --reproof-tiers full,burn "
                "(the default)")
    return None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the re-proof decided: RETURN, KEEP_OUT (new evidence) or HOLD (a lemon)."""
    verdict: str
    reason: str  # Slurm's reason / Kubernetes' annotation: one line within decide.REASON_MAX
    remedy: tuple[str, ...] = ()
    findings: tuple = ()


RETURN, KEEP_OUT, HOLD = "return", "keep-out", "hold"


def judge(runs: list[tuple[str, Exit, decide.NodeAction | None]], run_id: str, lemon: str) -> Outcome:
    """The re-proof's runs (tier, exit code, this node's action) -> the outcome. Proven: every tier completed
    (exit 0 or 1) and none asks to drain the node (an image or settings fault is not the node's). A lemon is
    held whatever the proof says."""
    failed = next(((tier, code, action) for tier, code, action in runs
                   if code not in (Exit.OK, Exit.FAILED) or (action is not None and action.drain)), None)
    if failed is not None:
        tier, code, action = failed
        if action is not None and action.drain:
            what = action.reason.removeprefix(decide.PREFIX).strip()
            first = action.findings[0]
            return Outcome(KEEP_OUT, decide.fit(f"{decide.PREFIX} re-proof {run_id} failed: {what}"),
                           policy.remedy_of(first), action.findings)
        return Outcome(KEEP_OUT, decide.fit(f"{decide.PREFIX} re-proof {run_id} ({tier}) not proven: exit "
                                            f"{int(code)} ({code.meaning})"))
    if lemon:
        return Outcome(HOLD, decide.fit(f"{history.HOLD_PREFIX}{lemon}"), (policy.SERVICE,))
    return Outcome(RETURN, decide.fit(f"{decide.PREFIX} returned by re-proof {run_id} "
                                      f"({'+'.join(t for t, _, _ in runs)} passed)"))


def commands(scheduler: str, node: str, outcome: Outcome, target: list[str] | None = None) -> list[list[str]]:
    """The scheduler's commands for the outcome. `target` (Kubernetes) replaces `node NAME`, e.g. `-f node.json
    --local -o json`, to apply them to a Node object without a cluster."""
    if scheduler == "slurm":
        if outcome.verdict == RETURN:
            return [["scontrol", "update", f"nodename={node}", "state=resume"],
                    ["scontrol", "update", f"nodename={node}", f"comment={outcome.reason}"]]
        return [["scontrol", "update", f"nodename={node}", "state=drain", f"reason={outcome.reason}"]]
    if scheduler == "kubernetes":
        where = target or ["node", node]
        if outcome.verdict == RETURN:
            return [["kubectl", "taint", *where, f"{kubernetes.TAINT_KEY}-"],
                    ["kubectl", "label", *where, f"{kubernetes.VERDICT_LABEL}=pass", "--overwrite"],
                    ["kubectl", "annotate", *where, f"{kubernetes.CHECK_ANNOTATION}-",
                     f"{SERVICE_ANNOTATION}-", f"{RETURNED_ANNOTATION}={outcome.reason}", "--overwrite"]]
        kept = [["kubectl", "label", *where, f"{kubernetes.VERDICT_LABEL}=fail", "--overwrite"],
                ["kubectl", "annotate", *where, f"{kubernetes.CHECK_ANNOTATION}={outcome.reason}", "--overwrite"],
                ["kubectl", "taint", *where, kubernetes.TAINT, "--overwrite"]]
        if outcome.verdict == HOLD:
            kept.insert(2, ["kubectl", "annotate", *where, f"{SERVICE_ANNOTATION}={outcome.reason}", "--overwrite"])
        return kept
    return []


# --- asking the scheduler and running the proof ---------------------------------------------------------------
def standing(node: str, scheduler: str | None, timeout_s: float) -> Standing:
    from stackproof.tools import run_tool

    if scheduler not in ("slurm", "kubernetes"):
        return Standing(IN_SERVICE)
    argv = slurm_query(node) if scheduler == "slurm" else kubernetes_query(node)
    try:
        out = run_tool(f"read {node}'s standing", argv, timeout_s=timeout_s, error=ActError,
                       fix="the scheduler's client must reach it (as for the drain)")
        return standing_of_slurm(out, node) if scheduler == "slurm" else standing_of_kubernetes(out)
    except (ActError, ValueError, AttributeError, TypeError) as err:
        return Standing(UNKNOWN, str(err))


def run_id(reports_dir: Path, keep_runs: int, started: float) -> str:
    """The name of a run in reasons and the history: its folder under runs/, else when it started."""
    from stackproof.report import folders

    if keep_runs:
        return folders.current(reports_dir).name
    return history._iso(started)


def reprove(validate_settings, settings, node: str, found: Standing, out: IO[str],
            env: Mapping[str, str]) -> int:
    """Prove a node stackproof took out, with every tier of --reproof-tiers in turn, and return it, keep it out
    with the new evidence, or hold it (a lemon). Exit: STAYS when returned, TAKEN_OUT when it stays out. `env`:
    the environment healthcheck launches in (act/run.as_launcher)."""

    say = lambda text: print(f"# stackproof healthcheck: {text}", file=out, flush=True)  # noqa: E731
    problem = reproof_problem(settings.reproof, validate_settings.tier)
    if problem:
        raise ConfigError(problem)
    deeper = covers(settings.reproof, validate_settings.tier)[1]
    say(f"this node is {found.words()}: re-proof with --reproof-tiers {','.join(settings.reproof)} "
        f"({'deeper than' if deeper else 'as deep as'} --tier {validate_settings.tier}) before it may return")
    state = validate_settings.health_state_dir
    guard = history.path(state, node).with_name(LOCK_FILE)
    guard.parent.mkdir(parents=True, exist_ok=True)
    try:
        # Detached: the lock is only looked at here (free: no re-proof running), and taken by the re-proof itself,
        # which waits --act-timeout for it (this process may still hold it for a moment).
        with lock.held(guard, 0 if not settings.reproof_foreground else settings.act_timeout):
            detach = not settings.reproof_foreground
            if not detach:
                return _reprove(validate_settings, settings, node, state, say, out, env)
        return _detach(validate_settings, say, env)
    except ActError as err:
        say(f"a re-proof of this node is already running ({str(err).partition('found it held by ')[2] or err}): "
            f"it stays out until that one passes; exit {int(Healthcheck.TAKEN_OUT)}")
        return Healthcheck.TAKEN_OUT


def _detach(validate_settings, say, env: Mapping[str, str]) -> int:
    """The re-proof in its own session (slurmd's kill of the HealthCheckProgram's process group does not reach
    it), this healthcheck's flags and --reproof-foreground; its output in reproof.log under --reports."""
    import subprocess
    import sys


    log = validate_settings.reports_dir / LOG_FILE
    log.parent.mkdir(parents=True, exist_ok=True)
    given = sys.argv[sys.argv.index("healthcheck") + 1:] if "healthcheck" in sys.argv else []
    argv = [sys.executable, "-m", "stackproof", "healthcheck", *given, "--reproof-foreground"]
    with open(log, "a") as sink:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=dict(env))
    say(f"re-proof started in the background (pid {child.pid}, its log {log}); this node stays out of service "
        f"until it passes; exit {int(Healthcheck.TAKEN_OUT)}")
    return Healthcheck.TAKEN_OUT


def _reprove(validate_settings, settings, node: str, state: Path, say, out: IO[str],
             env: Mapping[str, str]) -> int:
    from stackproof.run.config import BURN_HEADROOM_S
    from stackproof.run.launcher import launch

    try:
        events = history.load(state, node)
    except ValueError as err:
        say(f"its history cannot be read ({err}): it stays out")
        return Healthcheck.TAKEN_OUT
    runs, first_id = [], ""
    for tier in settings.reproof:
        tiered = dataclasses.replace(validate_settings, tier=tier)
        if tier == "burn":  # the soak's own time, not the health check's budget: the node is out of service
            tiered = dataclasses.replace(tiered, run_timeout=max(tiered.run_timeout,
                                                                 tiered.burn_seconds + BURN_HEADROOM_S))
        tiered = calls.writable_reports(tiered, say)
        started = time.time()
        try:
            record = launch(tiered, env=env)
        except ConfigError as err:
            say(f"re-proof ({tier}): bad input: {err}")
            runs.append((tier, Exit.USAGE, None))
            break
        this_id = run_id(tiered.reports_dir, tiered.keep_runs, started)
        first_id = first_id or this_id
        decision = decide.decide(record, not_before=started, node=node)
        action = next((a for a in decision.actions if a.node == node), None)
        say(f"re-proof ({tier}) run {this_id}: exit {int(record.exit_code)} ({record.exit_code.meaning})"
            + (f"; {action.words()}" if action is not None and action.failed else ""))
        runs.append((tier, record.exit_code, action))
        if record.exit_code not in (Exit.OK, Exit.FAILED) or (action is not None and action.drain):
            break
    now = time.time()
    events.append(history.Event(now, history.REPROVED, first_id, "passed" if len(runs) == len(settings.reproof)
                                and all(c in (Exit.OK, Exit.FAILED) and not (a and a.drain) for _, c, a in runs)
                                else "failed", tier=",".join(t for t, _, _ in runs)))
    outcome = judge(runs, first_id, history.needs_service(events, now, settings.lemon_rule))
    failures: list[str] = []
    # The re-proof took minutes: a person may have taken the node out for a reason of their own meanwhile (or
    # returned it). Only a node still out by stackproof is acted on.
    now_standing = standing(node, settings.scheduler, settings.act_timeout)
    if now_standing.state != OURS:
        say(f"during the re-proof this node became {now_standing.words()}: left as it is")
        if now_standing.state == IN_SERVICE:  # returned by a person meanwhile
            events.append(history.Event(now, history.SERVICED, first_id, "returned to service by someone else"))
        history.save(state, node, events)
        _export(validate_settings, node, events, now, settings)
        return Healthcheck.STAYS if now_standing.state == IN_SERVICE else Healthcheck.TAKEN_OUT
    argv = commands(settings.scheduler, node, outcome)
    done = calls.run_commands(node, argv, settings, calls.say_to(out), failures)
    kind = {RETURN: history.RETURNED, KEEP_OUT: history.KEPT_OUT, HOLD: history.HELD}[outcome.verdict]
    if outcome.verdict == RETURN and not done:
        kind = history.KEPT_OUT  # the resume itself failed: the node is still out
    events.append(history.Event(now, kind, first_id, outcome.reason, outcome.remedy))
    history.save(state, node, events)
    _export(validate_settings, node, events, now, settings)
    if outcome.remedy:
        say(f"remedy: {policy.remedy_words(outcome.remedy)}")
    if kind == history.RETURNED:
        say(f"{outcome.reason}; this node is back in service; exit {int(Healthcheck.STAYS)}")
        return Healthcheck.STAYS
    say(f"{outcome.reason}; this node stays out of service; exit {int(Healthcheck.TAKEN_OUT)}")
    return Healthcheck.TAKEN_OUT


def _export(validate_settings, node: str, events: list[history.Event], now: float, settings) -> None:
    from stackproof.report import folders

    run_dir = folders.current(validate_settings.reports_dir)
    if run_dir.is_dir():
        history.export(run_dir, node, events, now, settings.lemon_rule)


def after_check(done: decide.Decision | None, node: str, found: Standing, validate_settings, settings,
                run_dir_id: str, say) -> None:
    """The history of a healthcheck that proved a node in service: taken out now (a lemon is held at once, its
    reason saying it needs service), or returned by a person since stackproof last held it out (serviced).
    --scheduler none takes nothing out: it has no history."""
    if settings.scheduler not in ("slurm", "kubernetes"):
        return
    state = validate_settings.health_state_dir
    try:
        events = history.load(state, node)
    except ValueError as err:
        say(f"the node's history cannot be read ({err}); not recorded")
        return
    now = time.time()
    changed = False
    if found.state == IN_SERVICE and history.out_of_service(events):
        events.append(history.Event(now, history.SERVICED, run_dir_id, "returned to service by someone else"))
        changed = True
    action = next((a for a in (done.drains if done else ()) if a.node == node), None)
    if action is not None:
        remedy = policy.remedy_of(action.findings[0]) if action.findings else ()
        events.append(history.Event(now, history.TAKEN_OUT, run_dir_id, action.reason, remedy,
                                    validate_settings.tier))
        changed = True
        lemon = history.needs_service(events, now, settings.lemon_rule)
        if lemon:

            held = Outcome(HOLD, decide.fit(f"{history.HOLD_PREFIX}{lemon}"), (policy.SERVICE,))
            say(f"a lemon: {lemon}")
            calls.run_commands(node, commands(settings.scheduler, node, held), settings, say, [])
            events.append(history.Event(now, history.HELD, run_dir_id, held.reason, held.remedy))
    if changed:
        history.save(state, node, events)
    _export(validate_settings, node, events, now, settings)
