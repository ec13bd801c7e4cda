"""One deadline for the whole healthcheck (issue 25, part 5): by construction, the NVML survey, the ranks, stopping
them and acting fit in --deadline, and the default fits slurmd's 60 s; each scheduler call gets at most what is
left, so act keeps its time however long validate took."""

from __future__ import annotations

import time

import pytest

from stackproof.act import deadline as budget
from stackproof.act.config import ActConfig
from stackproof.errors import ConfigError
from stackproof.measure import topology
from stackproof.run import launch_env, local_ranks


def test_the_default_split_fits_slurmds_limit_by_construction():
    settings = ActConfig(scheduler="slurm")
    worst = (topology.SURVEY_DEADLINE_S + settings.ranks_budget_s + local_ranks.KILL_GRACE_S
             + 2 * local_ranks.KILL_WAIT_S + settings.act_budget)
    assert worst <= settings.deadline < budget.SLURMD_LIMIT_S
    assert settings.ranks_budget_s >= budget.SHORTEST_RANKS_S


def test_a_deadline_that_leaves_the_ranks_too_little_is_refused():
    with pytest.raises(ConfigError, match=r"--deadline 30 leaves the ranks .* fix: raise --deadline"):
        ActConfig(scheduler="slurm", deadline=30)
    default = ActConfig(scheduler="slurm")
    assert ActConfig(scheduler="slurm", deadline=300).ranks_budget_s == 300 - default.deadline + default.ranks_budget_s


def test_each_call_gets_at_most_what_is_left():
    deadline = budget.Deadline.start(0.2)
    assert 0.1 < deadline.call_timeout(30.0) <= 0.2 and deadline.call_timeout(0.05) == 0.05
    time.sleep(0.25)
    assert deadline.left() == 0.0 and deadline.call_timeout(30.0) == 0.0


def test_validates_run_timeout_is_cut_to_what_the_deadline_leaves():
    from stackproof.run.config import ValidateConfig

    act = ActConfig(scheduler="slurm")
    cut = budget.fit(ValidateConfig(run_timeout=50, timeout=40), act)  # the launcher cuts it again after the survey
    most = budget.ranks_most_s(act.deadline, act.act_budget)
    assert (cut.run_timeout, cut.timeout) == (most, min(40, most)) and most > act.ranks_budget_s
    short = ValidateConfig(run_timeout=5, timeout=5)
    assert budget.fit(short, act) is short


def test_a_split_that_leaves_the_watchdog_no_time_before_the_ranks_are_stopped_is_refused():
    """The ranks' shortest run and the VERDICT_S the watchdog fires before they are stopped must both fit after a
    survey that took its whole time (before issue 33 the split left a watchdog firing after the stop)."""
    default = ActConfig(scheduler="slurm")
    tight = default.deadline - default.ranks_budget_s + budget.SHORTEST_RANKS_S + launch_env.VERDICT_S / 2
    with pytest.raises(ConfigError, match=r"the watchdog fires before the ranks are stopped"):
        ActConfig(scheduler="slurm", deadline=tight)
    assert default.ranks_budget_s >= budget.SHORTEST_RANKS_S + launch_env.VERDICT_S


def test_the_watchdog_fires_before_the_launcher_stops_the_ranks():
    """A check's own limit (--timeout + grace) past the run's end is cut to the end less VERDICT_S."""
    from stackproof.run.watchdog import CheckWatchdog

    env = type("Env", (), {"is_gpu": False})()
    now = time.time()
    watchdog = CheckWatchdog(env, 30.0, lambda *a: None, run_ends=now + 20.0)
    assert watchdog.fires_in(now) == pytest.approx(20.0 - launch_env.VERDICT_S)
    assert watchdog.fires_in(now - 25.0) == 30.0  # a check that started early: its own limit comes first
    assert watchdog.fires_in(now + 19.0) == 0.0  # the end is past: at once
    assert CheckWatchdog(env, 30.0, lambda *a: None).fires_in(now) == 30.0  # no launcher of ours: the limit


def test_skip_busy_gpus_nvml_that_never_answers_ends_at_its_deadline(monkeypatch):
    """NVML stuck in the driver while --skip-busy-gpus lists the GPUs' processes: said, within its deadline (before
    issue 33 the call had none and the healthcheck waited until slurmd killed it)."""
    import threading

    import pynvml

    from stackproof.act import hardware

    release = threading.Event()
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: release.wait(30) and 0)
    started = time.monotonic()
    with pytest.raises(topology.NvmlUnavailable, match=r"NVML did not answer within 0\.3 s"):
        hardware.gpu_use(0.3)
    assert time.monotonic() - started < 1.5
    release.set()


SLEEPING_TOOL = """#!/usr/bin/env bash
# slurmctld not answering: the call waits {sleep_s} s, then prints what sinfo would ({line!r})
sleep {sleep_s}
printf '%s\\n' {line!r}
"""


def test_act_ends_within_the_deadline_against_a_scontrol_that_sleeps(tmp_path, monkeypatch):
    """Each scheduler call takes at most what is left of the deadline when it starts, the re-count's wait too:
    sinfo answering in 1 s and scontrol never within the deadline, act ends with it (before issue 33: one timeout
    computed up front for five calls and a 2 s sleep, past the deadline)."""
    import io

    from stackproof.act import decide
    from stackproof.act import run as act_run
    from stackproof.judge import policy

    shims = tmp_path / "shims"
    shims.mkdir()
    for tool, sleep_s, line in (("sinfo", 1, "n1|gpu|Unknown|none"), ("scontrol", 60, "")):
        (shims / tool).write_text(SLEEPING_TOOL.format(sleep_s=sleep_s, line=line))
        (shims / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{__import__('os').environ['PATH']}")
    decision = decide.Decision(decide.Exit.FAILED, "a check failed", actions=(
        decide.NodeAction("n1", policy.DRAIN, "stackproof: per_gpu::x GPU 0"),))
    settings = ActConfig(scheduler="slurm", node="n1", max_drained="100%")
    left_s = 4.0
    started = time.monotonic()
    _done, failures = act_run.act(decision, settings, io.StringIO(), budget.Deadline.start(left_s))
    took = time.monotonic() - started
    assert took < left_s + 1.0, f"act took {took:.1f} s with {left_s:g} s left"
    assert failures and "scontrol" in failures[0]
