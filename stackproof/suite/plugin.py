"""The pytest plugin that turns one pytest session per rank into one verdict.

Every rank runs the same tests in the same order. After each phase of each test the ranks exchange their
outcomes: a test passes only if it passed on every rank, and a failure on any rank is reported (by every rank,
so by rank 0's JUnit, table and exit code) with that rank's number and message.
"""

from __future__ import annotations

import os
import sys

import pytest

from stackproof.suite import dist as sp_dist
from stackproof.suite.config import ValidateConfig
from stackproof.suite.report import EXIT_INCOMPLETE, Check, Figure, Report
from stackproof.suite.watchdog import CheckWatchdog

DIST_KEY = pytest.StashKey[sp_dist.DistEnv]()
REPORT_KEY = pytest.StashKey[Report]()
SETTINGS_KEY = pytest.StashKey[ValidateConfig]()
WATCHDOG_KEY = pytest.StashKey[CheckWatchdog]()
# A check may run this much longer than --timeout before the watchdog names the rank holding it up: the
# collective's own timeout and the cross-rank sync get the first chance to say it.
WATCHDOG_GRACE_S = 10.0


class Recorder:
    """What a test hands to the report: figures, a hint for when it fails, and run-wide context."""

    def __init__(self, report: Report, check: Check, item: pytest.Item, is_main: bool):
        self._report, self._check, self._item, self._is_main = report, check, item, is_main

    def figure(self, name: str, value: float | int | str, unit: str = "") -> None:
        self._check.figures[name] = Figure(value, unit)
        self._item.user_properties.append((name, f"{value} {unit}".strip()))

    def hint(self, text: str) -> None:
        self._check.hint = text

    def context(self, key: str, value: object) -> None:
        self._report.context[key] = value

    def table(self, name: str, rows: list[dict]) -> None:
        self._report.tables[name] = rows

    def say(self, text: str) -> None:
        """Print on rank 0 only, straight to the terminal (past pytest's capture)."""
        if not self._is_main:
            return
        plugins = self._item.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if reporter is None or capture is None:
            print(text, file=sys.__stdout__, flush=True)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(text)


def pytest_configure(config: pytest.Config) -> None:
    settings = ValidateConfig.from_env()
    config.stash[SETTINGS_KEY] = settings
    config.stash[REPORT_KEY] = Report()
    config.stash[DIST_KEY] = env = sp_dist.init(settings.timeout_s)
    config.stash[WATCHDOG_KEY] = CheckWatchdog(env, settings.timeout_s + WATCHDOG_GRACE_S,
                                               lambda nodeid, message: _stalled(config, nodeid, message))
    config.addinivalue_line("markers", "gpu: needs at least one CUDA GPU (skipped on CPU with the reason)")
    config.addinivalue_line("markers", "multi_rank: needs a world of two or more ranks")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    env = config.stash[DIST_KEY]
    for item in items:
        if item.get_closest_marker("gpu") and not env.is_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this run is on CPU (gloo)"))
        if item.get_closest_marker("multi_rank") and env.world_size < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ ranks; this world has 1 "
                                                    "(run through `python -m stackproof validate`)"))


@pytest.fixture(scope="session")
def dist_env(request: pytest.FixtureRequest) -> sp_dist.DistEnv:
    return request.config.stash[DIST_KEY]


@pytest.fixture(scope="session")
def settings(request: pytest.FixtureRequest) -> ValidateConfig:
    return request.config.stash[SETTINGS_KEY]


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Recorder:
    config = request.config
    check = config.stash[REPORT_KEY].check(request.node.nodeid)
    return Recorder(config.stash[REPORT_KEY], check, request.node, config.stash[DIST_KEY].is_main)


def _message(rep: pytest.TestReport) -> str:
    if rep.skipped and isinstance(rep.longrepr, tuple):
        return str(rep.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else (rep.longreprtext or "")
    # Keep the assertion's own message, not pytest's re-rendering of the asserted expression.
    return text.split("\nassert ")[0].removeprefix("AssertionError: ").strip()[:2000]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    watchdog = item.config.stash[WATCHDOG_KEY]
    watchdog.arm(item.nodeid)
    try:
        return (yield)
    finally:
        watchdog.disarm()


def _stalled(config: pytest.Config, nodeid: str, message: str) -> None:
    """Rank 0's watchdog fired: the main thread is stuck, so write the verdict from here and end the rank."""
    report = config.stash[REPORT_KEY]
    check = report.check(nodeid)
    check.outcome, check.message = "failed", message
    report.verdict_override = (EXIT_INCOMPLETE, message)
    report.context.setdefault("world_size", config.stash[DIST_KEY].world_size)
    path = report.write(config.stash[SETTINGS_KEY].reports_dir)
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=False)  # fd 1 points at pytest's capture file until now
    print(f"\n{report.table()}\n# report: {path}", file=sys.__stdout__, flush=True)
    os._exit(EXIT_INCOMPLETE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    rep: pytest.TestReport = yield
    config = item.config
    env = config.stash[DIST_KEY]
    message = _message(rep)
    if env.world_size > 1 and not config.stash[REPORT_KEY].verdict_override:
        message = _agree(rep, message, env, f"{item.nodeid} ({call.when})", item)
    check = config.stash[REPORT_KEY].check(item.nodeid)
    check.duration_s += rep.duration
    if rep.failed or (rep.skipped and check.outcome != "failed"):
        check.outcome = rep.outcome
        check.message = check.message or message
    return rep


def _agree(rep: pytest.TestReport, message: str, env: sp_dist.DistEnv, what: str, item: pytest.Item) -> str:
    """Make this rank's report the world's: failed if any rank failed. Returns the message to record."""
    try:
        everyone = env.exchange({"outcome": rep.outcome, "message": message}, what)
    except sp_dist.RankTimeout as err:
        rep.outcome, rep.longrepr = "failed", str(err)
        item.session.shouldstop = str(err)
        item.config.stash[REPORT_KEY].verdict_override = (EXIT_INCOMPLETE, str(err))
        return str(err)
    failed: dict[str, list[int]] = {}
    for rank, outcome in enumerate(everyone):
        if outcome["outcome"] == "failed":
            failed.setdefault(outcome["message"], []).append(rank)
    skipped = [r for r, o in enumerate(everyone) if o["outcome"] == "skipped"]
    if failed:
        ranks = sorted(r for group in failed.values() for r in group)
        # Ranks that failed the same way are named together.
        text = f"failed on rank(s) {ranks} of {env.world_size}: " + " | ".join(
            f"rank(s) {group}: {msg}" if len(failed) > 1 else msg for msg, group in failed.items())
        if rep.failed:
            rep.longrepr = f"{rep.longreprtext}\n\n{text}"
        else:
            rep.outcome, rep.longrepr = "failed", text
        return text
    if skipped and len(skipped) != env.world_size:
        rep.outcome = "failed"
        rep.longrepr = (f"ranks disagree: skipped on {skipped}, ran on the others; the suite's skip decisions "
                        "must be the same on every rank")
        return str(rep.longrepr)
    return message


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    env = config.stash[DIST_KEY]
    if not env.is_main:
        return
    terminalreporter.write_line("")
    terminalreporter.write_line(config.stash[REPORT_KEY].table())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    env = config.stash.get(DIST_KEY, None)
    report = config.stash[REPORT_KEY]
    report.context.setdefault("world_size", env.world_size if env else 1)
    if env and env.is_main:
        report.write(config.stash[SETTINGS_KEY].reports_dir)
    if env and env.world_size > 1 and not report.verdict_override and exitstatus != pytest.ExitCode.INTERRUPTED:
        # Nobody exits before rank 0 has written the verdict: under a bare torchrun a rank's non-zero exit
        # makes torchrun stop the others.
        env.barrier("writing the report")


def pytest_unconfigure(config: pytest.Config) -> None:
    report = config.stash.get(REPORT_KEY, None)
    if report and report.verdict_override:
        # A peer is hung or dead: tearing the process group down could block on it. Leave now;
        # the launcher (torchrun) stops the other ranks when this one exits non-zero.
        sys.stdout.flush()
        os._exit(report.exit_code)
    sp_dist.shutdown()
