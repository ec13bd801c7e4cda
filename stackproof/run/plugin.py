"""The pytest plugin that turns one pytest session per rank into one verdict.

Every rank runs the same checks in the same order. At the end of each module of checks the ranks agree on the
outcomes in O(world) messages (DistEnv.agree): rank 0 reads every rank's outcomes and figures, records them, and
answers with the joint outcomes, so a failure on any rank is reported with that rank's number, node and GPU.
One agreement per module, not per check, keeps a 1024-rank run's sync cost to seconds (benchmarks/sync.py);
a rank that hangs inside a check is the per-check watchdog's to name.

pytest's own terminal output goes to the rank's log; stdout carries only the contract (report.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

import pytest

from stackproof import environment
from stackproof.errors import ConfigError, Exit, RankTimeout
from stackproof.judge import consensus, exceptions, promise
from stackproof.judge.findings import Finding, Judged, tool_error
from stackproof.measure import identity, pins
from stackproof.report import outputs, terminal
from stackproof.report.record import Figure, Report
from stackproof.run import dist as sp_dist
from stackproof.run import faults, phases, readings, smoke_tests_dir
from stackproof.run.config import ValidateConfig
from stackproof.run.launch_env import Told, launcher_started, run_ends
from stackproof.run.watchdog import CheckWatchdog

DIST_KEY = pytest.StashKey[sp_dist.DistEnv]()
REPORT_KEY = pytest.StashKey[Report]()
SETTINGS_KEY = pytest.StashKey[ValidateConfig]()
WATCHDOG_KEY = pytest.StashKey[CheckWatchdog]()
STDOUT_KEY = pytest.StashKey[IO[str]]()
# Under stackproof's own launcher (or scripts/torchrun) the launcher prints the final table; rank 0 does otherwise.
TOLD_KEY = pytest.StashKey[Told]()
NCCL_LOG_KEY = pytest.StashKey[str | None]()  # NCCL's log file pattern (%h, %p), or None: no log
PENDING_KEY = pytest.StashKey[list]()
# The run's exit code, as every rank learns it from rank 0 at the end (srun takes the highest of its tasks').
VERDICT_KEY = pytest.StashKey[int]()
# Run by stackproof's worker, which leaves the process at once afterwards (no teardown to wait for).
WORKER_KEY = pytest.StashKey[bool]()
IDENTITY_KEY = pytest.StashKey[identity.RankIdentity]()
# How far along the run is: the checks started, and the module of the last one.
PROGRESS_KEY = pytest.StashKey[list]()
# Readings taken beside the rank's start-up (run/readings.py): NVML held open, the GPU inventory.
READINGS_KEY = pytest.StashKey[readings.Early]()


@dataclasses.dataclass
class Running:
    """The running check, on this rank: its phases (outcome, message, seconds), the figures and the findings it
    handed over, and the first exception that was no assertion (type name, message, file:line)."""
    phases: list[tuple[str, str, float]] = dataclasses.field(default_factory=list)
    figures: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    found: list[Finding] = dataclasses.field(default_factory=list)
    error: tuple[str, str, str] | None = None


RUNNING_KEY = pytest.StashKey[Running]()


class Handover:
    """How the worker hands its objects to the plugin: the settings, the contract's stdout, what its launcher told
    it (who prints, when the run ends), where NCCL logs, the readings it started early."""

    def __init__(self, settings: ValidateConfig, stdout: IO[str] | None, told: Told, nccl_log: str | None,
                 early: readings.Early | None = None):
        self.settings, self.stdout, self.told, self.nccl_log = settings, stdout, told, nccl_log
        self.early = early  # started before the rank imported torch
        self.verdict: int | None = None  # what the run ended with, as this rank learnt it

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.verdict = config.stash.get(VERDICT_KEY, None)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[SETTINGS_KEY] = self.settings
        config.stash[STDOUT_KEY] = self.stdout
        config.stash[TOLD_KEY] = self.told
        config.stash[NCCL_LOG_KEY] = self.nccl_log
        config.stash[WORKER_KEY] = True
        if self.early is not None:
            config.stash[READINGS_KEY] = self.early


class Recorder:
    """What a check records beside its judgement: figures, run-wide context and tables, the contract's lines."""

    def __init__(self, config: pytest.Config, nodeid: str):
        self._config, self._nodeid = config, nodeid
        self._report, self._env = config.stash[REPORT_KEY], config.stash[DIST_KEY]

    def figure(self, name: str, value: float | int | str, unit: str = "") -> None:
        """On every rank: rank 0's figures are the check's; another rank's that differ are kept per rank."""
        self._config.stash[RUNNING_KEY].figures[name] = {"value": value, "unit": unit}

    def bad_input(self, message: str) -> None:
        """Input that turns out not to apply once the machine is known (a --baseline with no entry for it): the
        run ends as bad input, exit 2, never as a pass nor as a failure of the machine. Call it on every rank."""
        self._report.override = (Exit.USAGE, message)

    def so_far(self) -> Report:
        """The run's record as this rank holds it so far (rank 0: every rank's checks and figures until now)."""
        return self._report

    def context(self, key: str, value: object) -> None:
        self._report.context[key] = value

    def table(self, name: str, rows: list[dict]) -> None:
        self._report.tables[name] = rows

    def say(self, text: str) -> None:
        """Lines of the contract (data, or '#'-prefixed), on rank 0's stdout; a blank line becomes '#'."""
        if self._env.is_main:
            lines = [line if line.strip() else "#" for line in text.splitlines() or [""]]
            print("\n".join(lines), file=self._config.stash[STDOUT_KEY], flush=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "check(tiers, needs, optional='', optional_on=('gpu', 'cpu'), "
                                       "promised_by=''): the check's declaration (stackproof/judge/promise.py): its "
                                       "tiers, what it needs, and why a run that has that may still not judge it")
    settings = config.stash.get(SETTINGS_KEY, None) or ValidateConfig()
    config.stash[SETTINGS_KEY] = settings
    config.stash.setdefault(STDOUT_KEY, sys.stdout)
    if TOLD_KEY not in config.stash:  # pytest run on the suite directly, not by the worker: nobody settles after it
        given = environment.current()
        config.stash[TOLD_KEY] = Told(False, launcher_started(given), run_ends(given))
        config.stash[NCCL_LOG_KEY] = environment.NCCL_DEBUG_FILE.get(given) or None
    told = config.stash[TOLD_KEY]
    config.stash[RUNNING_KEY], config.stash[PENDING_KEY] = Running(), []
    if READINGS_KEY not in config.stash:  # the worker started them before torch's import; else now, beside
        config.stash[READINGS_KEY] = readings.Early(settings.pci_devices)  # CUDA's context and the world's join
    node = settings.node  # resolved once, for every check
    config.stash[DIST_KEY] = env = sp_dist.init(settings.rendezvous_timeout, settings.timeout, node)
    config.stash[REPORT_KEY] = report = Report(settings=settings.to_json())
    mine = identity.of_this_rank(env.rank, env.node_rank, env.local_rank, env.device.index if env.is_gpu else None,
                                 node)
    config.stash[IDENTITY_KEY] = mine
    everyone = env.gather({**mine.__dict__, "phases": phases.so_far()}, "start-up (who is where)")
    if env.is_main:
        report.context["phases"] = {"launcher_started": told.started,
                                    "ranks": [entry.pop("phases") for entry in everyone or []]}
        report.ranks = everyone or []
        report.world = {"size": env.world_size, "nodes": len({i["node"] for i in report.ranks}),
                        "backend": env.backend, "local_world_size": env.local_world_size}
        report.image = pins.image_description()
        outputs.write(report, settings.reports_dir)  # INCOMPLETE until the end: a killed run never leaves a pass behind
    config.stash[WATCHDOG_KEY] = CheckWatchdog(env, settings.watchdog_s,
                                               lambda nodeid, message, ranks: _stalled(config, nodeid, message, ranks),
                                               suite_dirs=(smoke_tests_dir(),), node=mine.node,
                                               run_ends=told.run_ends)


def declaration(item: pytest.Item) -> promise.Declaration:
    """The check's own declaration: a parametrization's mark, else the closest (test, then module)."""
    callspec = getattr(item, "callspec", None)
    marks = [m for m in getattr(callspec, "marks", ()) if m.name == "check"] or \
        [m for m in [item.get_closest_marker("check")] if m]
    if not marks:
        raise ConfigError(f"{item.nodeid}: expected a declaration, found none; fix: declare the check next to its "
                          "code, e.g. @pytest.mark.check(FULL, Needs(gpu=True)) (stackproof/judge/promise.py)")
    try:
        return promise.Declaration(*marks[0].args, **marks[0].kwargs)
    except TypeError as err:
        raise ConfigError(f"{item.nodeid}: expected a declaration check(tiers, needs, optional=...), found "
                          f"{err}; fix: see stackproof/judge/promise.py") from None
    except ConfigError as err:
        raise ConfigError(f"{item.nodeid}: {err}") from None


def has_api(dotted: str) -> bool:
    """Whether this torch has a dotted attribute (torch.distributed.fsdp.fully_shard): import what can be."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


@pytest.hookimpl(tryfirst=True)  # before -k deselects: the promise is the tier's, -k only narrows the proof
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    env, settings, report = config.stash[DIST_KEY], config.stash[SETTINGS_KEY], config.stash[REPORT_KEY]
    world = promise.World(size=env.world_size, nodes=env.num_nodes, local_size=env.local_world_size,
                          gpu=env.is_gpu)
    try:
        declared = {item.nodeid: declaration(item) for item in items}
    except ConfigError as err:  # nothing can be promised or left out: bad input, nothing judged
        report.override = (Exit.USAGE, str(err))
        config.hook.pytest_deselected(items=list(items))
        items[:] = []
        return
    report.declarations = {nodeid: d.to_json() for nodeid, d in declared.items()}
    outside = [item for item in items if settings.tier not in declared[item.nodeid].tiers]
    if outside:
        items[:] = [item for item in items if item not in outside]
        config.hook.pytest_deselected(items=outside)
    given = settings.to_json()
    for item in items:
        unmet = declared[item.nodeid].needs.unmet(world, given, has_api)
        if unmet:
            item.add_marker(pytest.mark.skip(reason=unmet))
    report.promised = promise.promised({item.nodeid: declared[item.nodeid] for item in items}, settings.tier,
                                       world, given, has_api)


def pytest_collection_finish(session: pytest.Session) -> None:
    report, settings = session.config.stash[REPORT_KEY], session.config.stash[SETTINGS_KEY]
    report.planned = [item.nodeid for item in session.items]
    report.context.setdefault("phases", {})["checks_started"] = time.time()
    if not session.items and not report.override:
        chosen = f"-k {settings.select!r}" if settings.select else f"--tier {settings.tier}"
        report.override = (Exit.USAGE, f"{chosen} selects none of the suite's checks; list them with "
                                       "`stackproof validate -- --collect-only -q`, e.g. -k collectives")


@pytest.fixture(scope="session")
def dist_env(request: pytest.FixtureRequest) -> sp_dist.DistEnv:
    return request.config.stash[DIST_KEY]


@pytest.fixture(scope="session")
def settings(request: pytest.FixtureRequest) -> ValidateConfig:
    return request.config.stash[SETTINGS_KEY]


@pytest.fixture(scope="session")
def nccl_log(request: pytest.FixtureRequest) -> str | None:
    """This rank's NCCL log file (the worker's pattern with NCCL's %h and %p filled in), or None: no log."""
    from stackproof.measure import bandwidth

    return bandwidth.own_nccl_log(request.config.stash[NCCL_LOG_KEY])


@pytest.fixture(scope="session")
def early_readings(request: pytest.FixtureRequest) -> readings.Early:
    """What this rank read beside its start-up (run/readings.py); a check waits for what it needs, bounded."""
    return request.config.stash[READINGS_KEY]


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Recorder:
    return Recorder(request.config, request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    config = item.config
    watchdog = config.stash[WATCHDOG_KEY]
    config.stash[RUNNING_KEY] = Running()
    _progress(item)
    watchdog.arm(item.nodeid)
    try:
        result = yield
        _record(item)
        if nextitem is None or nextitem.module is not item.module:
            _agree(item)
        return result
    finally:
        watchdog.disarm()


def _progress(item: pytest.Item) -> None:
    """Rank 0 says each module as it starts, and how far along the run is: a CPU run's modules take minutes, and
    the header alone left a person waiting without a word (issue 36 item 14)."""
    started = item.config.stash.setdefault(PROGRESS_KEY, [0, None])
    started[0] += 1
    if item.module is started[1]:
        return
    started[1] = item.module
    if item.config.stash[DIST_KEY].is_main:
        name = Report().check(item.nodeid).name.split("::")[0]
        print(f"# [{started[0]}/{len(item.session.items)}] {name} ...", file=item.config.stash[STDOUT_KEY],
              flush=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool:
    """A check's one interface: its test measures, calls its judge step and returns the Judged. Handed over here,
    the same for every check: the fix, the findings, and a failure that says them."""
    judged = pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames})
    if judged is None:
        return True
    if not isinstance(judged, Judged):
        raise TypeError(f"{pyfuncitem.nodeid}: a check returns stackproof.judge.findings.Judged or nothing, "
                        f"found {type(judged).__name__}")
    config = pyfuncitem.config
    if judged.hint:
        config.stash[REPORT_KEY].check(pyfuncitem.nodeid).hint = judged.hint
    # This rank's findings about the machine (its GPU, its node): each fails the check here and decides what is
    # done to the node. Stamped now, so that the failure's message names the rank and GPU as the record will.
    found = [stamp(f, config.stash[IDENTITY_KEY], Report().check(pyfuncitem.nodeid).name) for f in judged.findings]
    config.stash[RUNNING_KEY].found.extend(found)
    if found:
        raise AssertionError(dataclasses.replace(judged, findings=found).message)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    rep: pytest.TestReport = yield
    running = item.config.stash[RUNNING_KEY]
    running.phases.append((rep.outcome, _message(rep, call), rep.duration))
    error = call.excinfo
    if rep.failed and error is not None and not isinstance(error.value, AssertionError | pytest.fail.Exception):
        entry = error.traceback[-1] if error.traceback else None
        where = f"{Path(str(entry.path)).name}:{entry.lineno + 1}" if entry else ""
        if running.error is None:
            running.error = (type(error.value).__name__, str(error.value), where)
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


def _record(item: pytest.Item) -> None:
    """This rank's outcome of a check (the worst of its phases) and its figures, until the module's agreement;
    rank 0 records its own at once, so a verdict written early (the watchdog's) holds it."""
    config = item.config
    running = config.stash[RUNNING_KEY]
    phases = running.phases
    worst = max(phases, key=lambda p: consensus.OUTCOME_ORDER.index(p[0]), default=("passed", "", 0.0))
    outcome, message = worst[0], worst[1]
    findings = _findings(config, running, item.nodeid, outcome, message)
    if findings and outcome != "failed":  # a check that found something wrong fails, whatever it asserted
        outcome, message = "failed", " | ".join(map(str, findings))
    mine = {"nodeid": item.nodeid, "outcome": outcome, "message": message, "figures": running.figures,
            "findings": [f.to_json() for f in findings]}
    config.stash[PENDING_KEY].append(mine)
    if config.stash[DIST_KEY].is_main:
        check = config.stash[REPORT_KEY].check(item.nodeid)
        check.outcome, check.message = mine["outcome"], mine["message"]
        check.failed_ranks = [0] if mine["outcome"] == "failed" else []
        check.duration_s = sum(p[2] for p in phases)
        check.figures = {k: Figure(**f) for k, f in mine["figures"].items()}
        check.findings = findings


def _findings(config: pytest.Config, running: Running, nodeid: str, outcome: str, message: str) -> list[Finding]:
    """This rank's findings for the check, stamped with where they were found: those it handed over; else, when
    it failed, the exception as judge/exceptions.py reads it, or a bare assertion (a fixture's pytest.fail, an
    assert no judge step made), unclassified: an alert, never a drain."""
    found = list(running.found)
    name = Report().check(nodeid).name
    if not found and outcome == "failed":
        if running.error is not None:
            found = [exceptions.finding(name, *running.error)]
        else:
            gpu = config.stash[IDENTITY_KEY].gpu or {}
            found = [Finding(gpu.get("index"), str(gpu.get("uuid", "")), name, "the check to pass", message,
                             "unclassified", "triage", config.stash[REPORT_KEY].check(nodeid).hint or
                             "see the check's message and the rank's log")]
    return [stamp(f, config.stash[IDENTITY_KEY], name) for f in found]


def stamp(finding: Finding, me: identity.RankIdentity, source: str) -> Finding:
    """Where a finding of this rank was made: its node, rank, and its GPU's PCI address when it is about it."""
    gpu = me.gpu or {}
    own_gpu = finding.gpu_index is not None and finding.gpu_index == gpu.get("index")
    return finding.at(node=me.node, rank=me.rank, source=source,
                      **({"uuid": gpu.get("uuid"), "pci_bus_id": gpu.get("pci_bus_id")} if own_gpu else {}))


def _agree(item: pytest.Item) -> None:
    """One agreement over the checks recorded since the last one."""
    config = item.config
    env, report = config.stash[DIST_KEY], config.stash[REPORT_KEY]
    pending, config.stash[PENDING_KEY] = config.stash[PENDING_KEY], []
    if report.override or env.world_size == 1:  # a peer already timed out, or there is nobody to agree with
        return

    def decide(values: list[list[dict[str, Any]]]) -> None:
        """On rank 0: the joint outcome of each check goes into the report; the other ranks need no answer."""
        for index, nodeid in enumerate(entry["nodeid"] for entry in values[0]):
            out_of_step = (f"this rank did not run {nodeid} in step with rank 0 (the ranks collected different "
                           "checks)")
            runs = [v[index] if index < len(v) and v[index]["nodeid"] == nodeid else
                    {"outcome": "failed", "message": out_of_step, "figures": {},
                     "findings": [tool_error(Report().check(nodeid).name, out_of_step).at(rank=r).to_json()]}
                    for r, v in enumerate(values)]
            check = report.check(nodeid)
            check.findings = [Finding.from_json(f) for run in runs for f in run.get("findings", [])]
            check.rank_figures = {r: {k: Figure(**f) for k, f in run["figures"].items()}
                                  for r, run in enumerate(runs) if r and run["figures"] != runs[0]["figures"]}
            joint = consensus.joint_outcome(runs)
            check.outcome, check.message, check.failed_ranks = joint["outcome"], joint["message"], joint["ranks"]

    try:
        env.agree(pending, f"the checks of {item.module.__name__ if item.module else item.nodeid}", decide)
    except RankTimeout as err:
        report.override = (Exit.INCOMPLETE, str(err))
        item.session.shouldstop = str(err)
        if env.is_main:
            _stall_recorded(report, item.nodeid, str(err), err.ranks)


def _stall_recorded(report: Report, nodeid: str, message: str, ranks: list[int],
                    judged: list[Finding] | None = None) -> None:
    """The check that stalled, failed on the stalled ranks, with the watchdog's judgement of each (judge/hang.py:
    a GPU hang only inside a CUDA call NVML agrees with); without one (a peer late to an agreement) a tool
    timeout, which names no machine."""
    check = report.check(nodeid)
    check.outcome, check.message, check.failed_ranks = "failed", message, ranks
    node_of = {int(r["rank"]): r["node"] for r in report.ranks}
    check.findings = [f.at(node=node_of.get(f.rank, "") if f.rank is not None else "", source=check.name)
                      for f in judged or [tool_error(check.name, message, "see every rank's stacks in the reports "
                                                                           "folder's logs/")]]


def _stalled(config: pytest.Config, nodeid: str, message: str, ranks: list[int]) -> None:
    """Rank 0's watchdog fired: the main thread is stuck, so write the verdict from here and end the rank."""
    report = config.stash[REPORT_KEY]
    _stall_recorded(report, nodeid, message, ranks, config.stash[WATCHDOG_KEY].findings)
    report.override = (Exit.INCOMPLETE, message)
    _finish(config, report)
    os._exit(Exit.INCOMPLETE)


def _finish(config: pytest.Config, report: Report) -> None:
    """Rank 0's last word: the final report, and the table on stdout unless a launcher prints it."""
    report.complete = True
    report.context.setdefault("phases", {}).setdefault("checks_done", time.time())
    report.wall_time_s = time.time() - report.started
    report.context["syncs"] = config.stash[DIST_KEY]._seq
    report.context["peak_rss_bytes_rank0"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    path = outputs.write(report, config.stash[SETTINGS_KEY].reports_dir)
    if not config.stash[TOLD_KEY].settles:
        print(f"#\n{terminal.table(report)}\n# report: {path}", file=config.stash[STDOUT_KEY], flush=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    env, report = config.stash.get(DIST_KEY, None), config.stash.get(REPORT_KEY, None)
    if env is None or report is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED and not report.override:
        report.override = (Exit.INTERRUPTED, f"interrupted after {len(report.checks)} of {len(report.planned)} "
                                             "checks (Ctrl-C / SIGTERM)")
    if not report.override and (never := faults.never_injected(config.stash[SETTINGS_KEY])):
        report.override = (Exit.USAGE, never)  # on every rank: they ran the same checks
    if env.is_main:
        _finish(config, report)
    config.stash[VERDICT_KEY] = int(report.exit_code)
    # Skipped only when a peer may not answer (one timed out, or the run was interrupted): a rank with bad input
    # (said on every rank, or only on some) still agrees, so that no rank hands in to a rank 0 that left.
    if env.world_size > 1 and not (report.override and report.override[0] in (Exit.INCOMPLETE, Exit.INTERRUPTED)):
        # Nobody exits before rank 0 has written the verdict (under a bare torchrun a rank's non-zero exit makes
        # torchrun stop the others), and every rank leaves knowing it.
        try:
            final = env.agree(None, "the verdict", lambda _values: {
                "exit_code": int(report.exit_code), "message": report.message, "node": report.ranks[0]["node"]})
            env.leave()
        except RankTimeout:
            final = {"exit_code": int(Exit.INCOMPLETE), "message": "rank 0 did not say the verdict", "node": "?"}
        config.stash[VERDICT_KEY] = final["exit_code"]
        reports = config.stash[SETTINGS_KEY].reports_dir
        if env.local_rank == 0 and not env.is_main and not (reports / "report.json").exists():
            # Another node, with a reports folder of its own: it gets the verdict too (a pod's /reports).
            outputs.write(Report(override=(final["exit_code"], f"{final['message']} (the full report is in rank 0's "
                                                          f"reports folder, on {final['node']})"), complete=True),
                          reports)


def pytest_unconfigure(config: pytest.Config) -> None:
    early = config.stash.get(READINGS_KEY, None)
    if early is not None and not config.stash.get(WORKER_KEY, False):
        early.close()
    report = config.stash.get(REPORT_KEY, None)
    if report and report.override and report.exit_code == Exit.INCOMPLETE:
        # A peer is hung or dead: tearing the process group down could block on it. Leave now;
        # the launcher (torchrun) stops the other ranks when this one exits non-zero.
        sys.stdout.flush()
        os._exit(report.exit_code)
    if not config.stash.get(WORKER_KEY, False):
        sp_dist.shutdown()
