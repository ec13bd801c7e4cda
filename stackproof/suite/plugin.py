"""The pytest plugin that turns one pytest session per rank into one verdict.

Every rank runs the same checks in the same order. After each check the ranks agree on its outcome in O(world)
messages (DistEnv.agree): rank 0 reads every rank's outcome and figures, records them, and answers with the
joint outcome, so a failure on any rank is reported with that rank's number, node and GPU.

pytest's own terminal output goes to the rank's log; stdout carries only the contract (report.py).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import IO, Any

import pytest

from stackproof.errors import Exit, RankTimeout
from stackproof.suite import consensus, identity, pins, smoke_tests_dir
from stackproof.suite import dist as sp_dist
from stackproof.suite.config import ValidateConfig
from stackproof.suite.report import CATEGORIES, SEVERITIES, Figure, Report
from stackproof.suite.watchdog import CheckWatchdog

DIST_KEY = pytest.StashKey[sp_dist.DistEnv]()
REPORT_KEY = pytest.StashKey[Report]()
SETTINGS_KEY = pytest.StashKey[ValidateConfig]()
WATCHDOG_KEY = pytest.StashKey[CheckWatchdog]()
STDOUT_KEY = pytest.StashKey[IO[str]]()
# Under stackproof's own launcher (or scripts/torchrun) the launcher prints the final table; rank 0 does otherwise.
LAUNCHED_KEY = pytest.StashKey[bool]()
PHASES_KEY = pytest.StashKey[list]()
FIGURES_KEY = pytest.StashKey[dict]()


class Handover:
    """How the worker hands its objects to the plugin: the settings, the contract's stdout, who prints."""

    def __init__(self, settings: ValidateConfig, stdout: IO[str], launched: bool):
        self.settings, self.stdout, self.launched = settings, stdout, launched

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[SETTINGS_KEY] = self.settings
        config.stash[STDOUT_KEY] = self.stdout
        config.stash[LAUNCHED_KEY] = self.launched


class Recorder:
    """What a check hands to the report: figures, the fix for when it fails, its category, run-wide context."""

    def __init__(self, config: pytest.Config, nodeid: str):
        self._config, self._nodeid = config, nodeid
        self._report, self._env = config.stash[REPORT_KEY], config.stash[DIST_KEY]

    def figure(self, name: str, value: float | int | str, unit: str = "") -> None:
        """On every rank: rank 0's figures are the check's; another rank's that differ are kept per rank."""
        self._config.stash[FIGURES_KEY][name] = {"value": value, "unit": unit}

    def hint(self, text: str) -> None:
        self._report.check(self._nodeid).hint = text

    def classify(self, category: str, severity: str) -> None:
        """What a failure of this check means for the machine (DCGM's vocabulary): see report.CATEGORIES."""
        assert category in CATEGORIES and severity in SEVERITIES, (category, severity)
        check = self._report.check(self._nodeid)
        check.category, check.severity = category, severity

    def context(self, key: str, value: object) -> None:
        self._report.context[key] = value

    def table(self, name: str, rows: list[dict]) -> None:
        self._report.tables[name] = rows

    def say(self, text: str) -> None:
        """A line of the contract (data, or '#'-prefixed), on rank 0's stdout."""
        if self._env.is_main:
            print(text, file=self._config.stash[STDOUT_KEY], flush=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs at least one CUDA GPU (skipped on CPU with the reason)")
    config.addinivalue_line("markers", "multi_rank: needs a world of two or more ranks")
    config.addinivalue_line("markers", "fast: part of --tier fast (identity, health, per-GPU checks)")
    settings = config.stash.get(SETTINGS_KEY, None) or ValidateConfig()
    config.stash[SETTINGS_KEY] = settings
    config.stash.setdefault(STDOUT_KEY, sys.stdout)
    config.stash.setdefault(LAUNCHED_KEY, False)
    config.stash[PHASES_KEY], config.stash[FIGURES_KEY] = [], {}
    config.stash[DIST_KEY] = env = sp_dist.init(settings.rendezvous_timeout, settings.timeout)
    config.stash[REPORT_KEY] = report = Report(settings=_settings_json(settings))
    mine = identity.of_this_rank(env.rank, env.node_rank, env.local_rank, env.device.index if env.is_gpu else None)
    everyone = env.gather(mine.__dict__, "start-up (who is where)")
    if env.is_main:
        report.ranks = everyone or []
        report.world = {"size": env.world_size, "nodes": len({i["node"] for i in report.ranks}),
                        "backend": env.backend, "local_world_size": env.local_world_size}
        report.image = pins.image_description()
        report.write(settings.reports_dir)  # INCOMPLETE until the end: a killed run never leaves a pass behind
    config.stash[WATCHDOG_KEY] = CheckWatchdog(env, settings.watchdog_s,
                                               lambda nodeid, message, ranks: _stalled(config, nodeid, message, ranks),
                                               suite_dirs=(smoke_tests_dir(),))


def _settings_json(settings: ValidateConfig) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    env, settings = config.stash[DIST_KEY], config.stash[SETTINGS_KEY]
    if settings.tier == "fast":
        slow = [item for item in items if not item.get_closest_marker("fast")]
        items[:] = [item for item in items if item.get_closest_marker("fast")]
        config.hook.pytest_deselected(items=slow)
    for item in items:
        if item.get_closest_marker("gpu") and not env.is_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this run is on CPU (gloo)"))
        if item.get_closest_marker("multi_rank") and env.world_size < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ ranks; this world has 1 "
                                                    "(run through `python -m stackproof validate`)"))


def pytest_collection_finish(session: pytest.Session) -> None:
    report, settings = session.config.stash[REPORT_KEY], session.config.stash[SETTINGS_KEY]
    report.planned = [item.nodeid for item in session.items]
    if not session.items:
        chosen = f"-k {settings.select!r}" if settings.select else f"--tier {settings.tier}"
        report.override = (Exit.USAGE, f"{chosen} selects none of the suite's checks; list them with "
                                       "`stackproof validate -- --collect-only -q`, e.g. -k collectives")


@pytest.fixture(scope="session")
def dist_env(request: pytest.FixtureRequest) -> sp_dist.DistEnv:
    return request.config.stash[DIST_KEY]


@pytest.fixture(scope="session")
def settings(request: pytest.FixtureRequest) -> ValidateConfig:
    return request.config.stash[SETTINGS_KEY]


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Recorder:
    return Recorder(request.config, request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    config = item.config
    watchdog = config.stash[WATCHDOG_KEY]
    config.stash[PHASES_KEY], config.stash[FIGURES_KEY] = [], {}
    watchdog.arm(item.nodeid)
    try:
        result = yield
        _agree_on(item)
        return result
    finally:
        watchdog.disarm()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    rep: pytest.TestReport = yield
    item.config.stash[PHASES_KEY].append((rep.outcome, _message(rep, call), rep.duration))
    return rep


def _message(rep: pytest.TestReport, call: pytest.CallInfo) -> str:
    """The assertion's or exception's own words (not pytest's re-rendering of the asserted expression)."""
    if rep.passed:
        return ""
    excinfo = call.excinfo
    if excinfo is not None:
        if rep.skipped:
            return str(getattr(excinfo.value, "msg", excinfo.value))
        value = excinfo.value
        text = str(value).split("\nassert ")[0].strip()
        if not isinstance(value, AssertionError):
            text = f"{type(value).__name__}: {text}"
        return text[:2000] or type(value).__name__
    if rep.skipped and isinstance(rep.longrepr, tuple):  # skipped by a mark: no exception was raised
        return str(rep.longrepr[2]).removeprefix("Skipped: ")
    return rep.longreprtext[:2000]


def _agree_on(item: pytest.Item) -> None:
    """One agreement per check: this rank's outcome (the worst of its phases) and figures go to rank 0."""
    config = item.config
    env, report = config.stash[DIST_KEY], config.stash[REPORT_KEY]
    phases = config.stash[PHASES_KEY]
    if report.override:  # a peer already timed out: nothing more can be agreed
        return
    worst = max(phases, key=lambda p: consensus.OUTCOME_ORDER.index(p[0]), default=("passed", "", 0.0))
    mine = {"outcome": worst[0], "message": worst[1], "figures": config.stash[FIGURES_KEY]}
    check = report.check(item.nodeid) if env.is_main else None

    def decide(values: list[dict[str, Any]]) -> dict[str, Any]:
        joint = consensus.joint_outcome(values)
        check.figures = {k: Figure(**f) for k, f in values[0]["figures"].items()}
        check.rank_figures = {r: {k: Figure(**f) for k, f in v["figures"].items()}
                              for r, v in enumerate(values) if r and v["figures"] != values[0]["figures"]}
        return {"outcome": joint["outcome"], "message": joint["message"], "ranks": joint["ranks"]}

    try:
        joint = env.agree(mine, f"check {item.nodeid}", decide)
    except RankTimeout as err:
        joint = {"outcome": "failed", "message": str(err), "ranks": []}
        report.override = (Exit.INCOMPLETE, str(err))
        item.session.shouldstop = str(err)
    if check is not None:
        check.outcome, check.message, check.failed_ranks = joint["outcome"], joint["message"], joint["ranks"]
        check.duration_s = sum(p[2] for p in phases)


def _stalled(config: pytest.Config, nodeid: str, message: str, ranks: list[int]) -> None:
    """Rank 0's watchdog fired: the main thread is stuck, so write the verdict from here and end the rank."""
    report = config.stash[REPORT_KEY]
    check = report.check(nodeid)
    check.outcome, check.message, check.failed_ranks = "failed", message, ranks
    report.override = (Exit.INCOMPLETE, message)
    _finish(config, report)
    os._exit(Exit.INCOMPLETE)


def _finish(config: pytest.Config, report: Report) -> None:
    """Rank 0's last word: the final report, and the table on stdout unless a launcher prints it."""
    report.complete = True
    report.wall_time_s = time.time() - report.started
    report.context["syncs"] = config.stash[DIST_KEY]._seq
    report.context["peak_rss_bytes_rank0"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    path = report.write(config.stash[SETTINGS_KEY].reports_dir)
    if not config.stash[LAUNCHED_KEY]:
        print(f"\n{report.table()}\n# report: {path}", file=config.stash[STDOUT_KEY], flush=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    env, report = config.stash.get(DIST_KEY, None), config.stash.get(REPORT_KEY, None)
    if env is None or report is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED and not report.override:
        report.override = (Exit.INTERRUPTED, f"interrupted after {len(report.checks)} of {len(report.planned)} "
                                             "checks (Ctrl-C / SIGTERM)")
    if env.is_main:
        _finish(config, report)
    if env.world_size > 1 and not report.override:
        # Nobody exits before rank 0 has written the verdict: under a bare torchrun a rank's non-zero exit
        # makes torchrun stop the others.
        try:
            env.barrier("writing the report")
        except RankTimeout:
            pass


def pytest_unconfigure(config: pytest.Config) -> None:
    report = config.stash.get(REPORT_KEY, None)
    if report and report.override and report.exit_code == Exit.INCOMPLETE:
        # A peer is hung or dead: tearing the process group down could block on it. Leave now;
        # the launcher (torchrun) stops the other ranks when this one exits non-zero.
        sys.stdout.flush()
        os._exit(report.exit_code)
    sp_dist.shutdown()
