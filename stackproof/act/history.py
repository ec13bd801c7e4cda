"""Each node's history with stackproof: taken out (why, the remedy), re-proved (passed or not, the run), returned,
held. Kept in the node's state folder (`<state>/<node>/history.json`, beside the watermarks: the same folder a
DaemonSet keeps on a hostPath), replaced atomically; a copy goes into each healthcheck run's folder as
`node-history.json` (the page reads it there, beside report.json) and its figures into `stackproof-history.prom`
(node_exporter's textfile collector reads the run's folder: `latest`).

A lemon node: one taken out again within --lemon-window after stackproof returned it, --lemon-count times in all
(twice in 7 days by default). It stays out and says it needs service, whatever its next proof says: Meta's and
Google's fleet papers find a few such nodes behind a large share of lost training time. A person who services
it returns it (`scontrol update state=resume`, `kubectl taint ... -`); the next healthcheck sees it in service and
records `serviced`, which starts its count again.

The rules (`standing`, `needs_service`) are pure functions of the events; `load`/`save` are the only file IO."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from stackproof.act import policy
from stackproof.act.decide import PREFIX

FILE = "history.json"  # in <state>/<node>/
RUN_COPY = "node-history.json"  # the copy in a healthcheck run's folder (the page's input)
METRICS_FILE = "stackproof-history.prom"
SCHEMA = "stackproof.history/1"
KEEP_EVENTS = 200  # the newest events kept: years of hourly checks' take-outs, a few kB

TAKEN_OUT, REPROVED, RETURNED, KEPT_OUT, HELD, SERVICED = (
    "taken-out", "re-proof", "returned", "kept-out", "held", "serviced")
EVENTS = (TAKEN_OUT, REPROVED, RETURNED, KEPT_OUT, HELD, SERVICED)
LEMON_WINDOW_S = 7 * 24 * 3600.0
HOLD_PREFIX = f"{PREFIX} needs service: "  # a held node's reason (act/resume.py)
LEMON_COUNT = 2

OUT_OF_SERVICE = "stackproof_node_out_of_service"
TAKEN_OUT_IN_WINDOW = "stackproof_node_taken_out_in_window"
LAST_TAKEN_OUT = "stackproof_node_last_taken_out_timestamp_seconds"
LAST_RETURNED = "stackproof_node_last_returned_timestamp_seconds"
NEEDS_SERVICE = "stackproof_node_needs_service"
HELP = {
    OUT_OF_SERVICE: "1 while stackproof holds the node out of service (drained / tainted by it), 0 in service",
    TAKEN_OUT_IN_WINDOW: "times stackproof took the node out within the lemon window (label window, seconds)",
    LAST_TAKEN_OUT: "when stackproof last took the node out (Unix time)",
    LAST_RETURNED: "when stackproof last returned the node after a re-proof (Unix time)",
    NEEDS_SERVICE: "1 when the node was taken out again within the lemon window after its return (a lemon node): "
                   "it stays out until a person services it, whatever its next proof says",
}


@dataclasses.dataclass(frozen=True)
class Event:
    at: float  # Unix time
    event: str  # one of EVENTS
    run: str = ""  # the run that did it (its folder's name under runs/, or its start)
    reason: str = ""  # the scheduler's reason / what was found
    remedy: tuple[str, ...] = ()  # the steps (act/policy.py), taken out / kept out only
    tier: str = ""  # the proof's tiers

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["remedy"] = list(self.remedy)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        names = {f.name for f in dataclasses.fields(cls)}
        event = cls(**{k: v for k, v in data.items() if k in names})
        if event.event not in EVENTS or not isinstance(event.at, (int, float)):
            raise ValueError(f"an event {event.event!r} at {event.at!r}")
        return dataclasses.replace(event, remedy=tuple(event.remedy))


@dataclasses.dataclass(frozen=True)
class Rule:
    window_s: float = LEMON_WINDOW_S
    count: int = LEMON_COUNT


def _since_serviced(events: list[Event]) -> list[Event]:
    last = max((i for i, e in enumerate(events) if e.event == SERVICED), default=-1)
    return events[last + 1:]


def out_of_service(events: list[Event]) -> bool:
    """stackproof holds the node out: its last take-out, keep-out or hold has no return or service after it."""
    for event in reversed(events):
        if event.event in (RETURNED, SERVICED):
            return False
        if event.event in (TAKEN_OUT, KEPT_OUT, HELD):
            return True
    return False


def needs_service(events: list[Event], now: float, rule: Rule = Rule()) -> str:
    """Why the node is a lemon ('' when it is not): taken out `rule.count` times within `rule.window_s` (since
    it was last serviced), at least one of them after stackproof had returned it; or held already (a hold lasts
    until a person services the node)."""
    events = _since_serviced(events)
    if any(e.event == HELD for e in events):
        held = next(e for e in reversed(events) if e.event == HELD)
        # the hold's own words, without the scheduler's prefix (the caller puts it back once)
        return held.reason.removeprefix(HOLD_PREFIX) or f"held as needing service ({held.run or _iso(held.at)})"
    outs = [e for e in events if e.event == TAKEN_OUT and now - e.at <= rule.window_s]
    returns = [e for e in events if e.event == RETURNED]
    if len(outs) < rule.count or not any(outs[0].at <= r.at <= outs[-1].at for r in returns):
        return ""
    days = rule.window_s / 86400
    return (f"taken out {len(outs)} times in {days:g} days, again after its return "
            f"({', '.join(e.run or _iso(e.at) for e in outs)}): needs service ({policy.STEPS[policy.SERVICE]})")


def counts(events: list[Event], now: float, rule: Rule = Rule()) -> dict[str, float]:
    """The figures a textfile exports (the names of HELP)."""
    outs = [e.at for e in _since_serviced(events) if e.event == TAKEN_OUT and now - e.at <= rule.window_s]
    figures = {OUT_OF_SERVICE: float(out_of_service(events)), TAKEN_OUT_IN_WINDOW: float(len(outs)),
               NEEDS_SERVICE: float(bool(needs_service(events, now, rule)) and out_of_service(events))}
    last_out = [e.at for e in events if e.event == TAKEN_OUT]
    last_back = [e.at for e in events if e.event == RETURNED]
    if last_out:
        figures[LAST_TAKEN_OUT] = max(last_out)
    if last_back:
        figures[LAST_RETURNED] = max(last_back)
    return figures


def textfile(node: str, events: list[Event], now: float, rule: Rule = Rule()) -> str:
    figures = counts(events, now, rule)
    lines = []
    for name, help_text in HELP.items():
        if name not in figures:
            continue
        labels = f'node="{node}",window="{rule.window_s:g}"' if name == TAKEN_OUT_IN_WINDOW else f'node="{node}"'
        value = figures[name]
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f"{name}{{{labels}}} {int(value) if value == int(value) else value!r}"]
    return "\n".join(lines) + "\n"


def _iso(at: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat(timespec="seconds")


def document(node: str, events: list[Event], now: float, rule: Rule = Rule()) -> dict[str, Any]:
    """The history as the run's copy says it (RUN_COPY): the events and where the node stands."""
    return {"schema": SCHEMA, "node": node, "out_of_service": out_of_service(events),
            "needs_service": needs_service(events, now, rule) if out_of_service(events) else "",
            "lemon_rule": {"window_s": rule.window_s, "count": rule.count},
            "events": [e.to_json() for e in events]}


# --- the state folder ------------------------------------------------------------------------------------------
def path(state_dir: str | Path, node: str) -> Path:
    from stackproof.measure.watermark import state_file

    return state_file(state_dir, node, "x").with_name(FILE)


def load(state_dir: str | Path, node: str) -> list[Event]:
    """The node's events, oldest first; none when there is no file. A damaged file is a ValueError saying so
    (the caller keeps the node out rather than return it on a history it cannot read)."""
    file = path(state_dir, node)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: expected a stackproof node history ({SCHEMA}), found {err}; fix: move it away "
                         "(the node's history then starts again)") from None
    try:
        assert isinstance(data, dict) and data.get("schema") == SCHEMA
        return [Event.from_json(e) for e in data["events"]]
    except (AssertionError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{file}: expected a stackproof node history ({SCHEMA}), found another shape "
                         f"({err or 'schema'}); fix: move it away (the node's history then starts again)") from None


def save(state_dir: str | Path, node: str, events: list[Event]) -> Path:
    file = path(state_dir, node)
    file.parent.mkdir(parents=True, exist_ok=True)
    events = events[-KEEP_EVENTS:]
    tmp = file.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"schema": SCHEMA, "node": node, "events": [e.to_json() for e in events]},
                              indent=1) + "\n")
    os.replace(tmp, file)
    return file


def append(state_dir: str | Path, node: str, event: Event) -> list[Event]:
    events = [*load(state_dir, node), event]
    save(state_dir, node, events)
    return events


def export(run_dir: Path, node: str, events: list[Event], now: float, rule: Rule = Rule()) -> None:
    """The run's copy of the history and its metrics, beside report.json and stackproof.prom."""
    for name, text in ((RUN_COPY, json.dumps(document(node, events, now, rule), indent=1) + "\n"),
                       (METRICS_FILE, textfile(node, events, now, rule))):
        tmp = run_dir / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, run_dir / name)
