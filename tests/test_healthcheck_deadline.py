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
from stackproof.run import local_ranks


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
    cut = budget.fit(ValidateConfig(run_timeout=50, timeout=20), act)
    assert (cut.run_timeout, cut.timeout) == (act.ranks_budget_s, min(20, act.ranks_budget_s))
    short = ValidateConfig(run_timeout=5, timeout=5)
    assert budget.fit(short, act) is short
