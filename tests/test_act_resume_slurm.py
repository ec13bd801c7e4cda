"""Back in service only by proof, on a real Slurm cluster of its own (scripts/ci/slurm-cluster.sh under another
name and ports, as root): slurmd runs scripts/slurm/healthcheck.sh as its HealthCheckProgram every 5 s on every
node, drained ones too (HealthCheckNodeState=ANY), through a site wrapper that says which node checks now and
which has a broken torch (tests/fixtures/broken_allreduce on its PYTHONPATH: all_reduce's sums are wrong, from
outside the suite). The node's state folder (--state-dir) is kept across the steps, as a site keeps it.

One node's life, in order (each step is slurmd's own health check on that node):
  1. n2 with the fault: drained, its history says taken out;
  2. the fault still there: the check on the drained n2 re-proves it, fails, and n2 stays drained with the new
     evidence (the reason names the re-proof run);
  3. the fault removed: the re-proof passes and n2 is resumed, its Comment naming the run;
  4. the fault back: taken out again within the lemon window after its return: held, needs service;
  5. the fault removed again: the re-proof passes, and n2 still stays out (a lemon is held whatever it says);
  6. a person services and resumes it: the next check records it serviced, its lemon count starts again.
And n1, drained by an operator for another reason (while its re-proof runs, or at any time), is never checked nor
resumed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.act import history
from stackproof.errors import Healthcheck
from stackproof.judge import policy

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
HEALTHCHECK = REPO / "scripts" / "slurm" / "healthcheck.sh"
CLUSTER = REPO / "scripts" / "ci" / "slurm-cluster.sh"
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
CONF = "/etc/slurm-return/slurm.conf"
# One CPU rank, one exact all_reduce (--deadline 120: torch ranks on a busy 2-core host). The re-proof runs the
# same selection in the full tier: the default (full, then the burn soak) is held in tests/test_act_resume.py;
# here CPU time is kept small.
CHECKS = ("--expect-gpus 0 --nproc 1 --tier full --max-check-bytes 64K --timeout 20 --run-timeout 50 --deadline 120 "
          "--reproof-tiers full")
SELECTION = "all_reduce and sum-float32"
TAKEN = "stackproof: collectives::all_reduce[sum-float32] rank 0"
WAIT_S = 150

WRAPPER = """#!/usr/bin/env bash
# The site's settings for slurmd's HealthCheckProgram (this test's step decides who checks, once per step).
dir={dir}
[ -f "$dir/step" ] || exit 0
grep -qx "$SLURMD_NODENAME" "$dir/nodes" || exit 0
id="$(cat "$dir/step")"
mkdir -p "$dir/runs/$id" && mkdir "$dir/runs/$id/$SLURMD_NODENAME" 2>/dev/null || exit 0
export STACKPROOF_PYTHON={python} STACKPROOF_REPO={repo} OMP_NUM_THREADS=1 SLURM_CONF={conf}
export STACKPROOF_HEALTHCHECK_REPORTS="$dir/runs/$id"
export STACKPROOF_HEALTHCHECK_ARGS="{checks} --state-dir $dir/state $(cat "$dir/extra")"
[ ! -f "$dir/broken/$SLURMD_NODENAME" ] || export PYTHONPATH={broken}
exec bash {script} -k "{selection}"
"""


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STACKPROOF_", "PYTEST_"))},
            "SLURM_CONF": CONF, "SLURM_CLUSTER_NAME": "stackproof-return", "SLURM_CLUSTER_PORT_BASE": "7317"}


def _slurm(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=_env(), check=check).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        if os.environ.get("STACKPROOF_REQUIRE_SLURM") == "1":
            pytest.fail("STACKPROOF_REQUIRE_SLURM=1 but slurmd running healthcheck.sh needs root")
        pytest.skip("slurmd running healthcheck.sh needs root (scripts/ci/slurm-cluster.sh)")
    folder = tmp_path_factory.mktemp("resume-slurm")
    folder.chmod(0o755)
    wrapper = folder / "site-healthcheck.sh"
    wrapper.write_text(WRAPPER.format(dir=folder, python=PYTHON, repo=REPO, conf=CONF, checks=CHECKS,
                                      broken=BROKEN_ALLREDUCE, script=HEALTHCHECK, selection=SELECTION))
    wrapper.chmod(0o755)
    (folder / "broken").mkdir()
    (folder / "extra").write_text("")
    extra = f"HealthCheckProgram={wrapper}\nHealthCheckInterval=5\nHealthCheckNodeState=ANY"
    env = {**_env(), "SLURM_CLUSTER_EXTRA_CONF": extra, "SLURM_CLUSTER_WAIT_S": "90"}
    # A cluster of this name left running (by hand, or a killed run) would be taken as it is, without this
    # HealthCheckProgram: stopped first, the script writes the conf anew.
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120, env=env)
    up = subprocess.run(["bash", str(CLUSTER)], capture_output=True, text=True, timeout=600, env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    for node in ("n1", "n2", "n3"):
        _slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)
    yield folder
    (folder / "step").unlink(missing_ok=True)
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120, env=env)


def _step(folder: Path, node: str, *, broken: bool, extra: str = "--reproof-foreground") -> str:
    """slurmd's next health check on `node`, with or without the fault; its healthcheck.log. The re-proof runs
    inside the health check (--reproof-foreground) unless `extra` says otherwise."""
    (folder / "step").unlink(missing_ok=True)
    (folder / "extra").write_text(extra)
    (folder / "broken" / node).unlink(missing_ok=True)
    if broken:
        (folder / "broken" / node).write_text("")
    (folder / "nodes").write_text(node + "\n")
    step = f"{node}-{time.monotonic_ns()}"
    (folder / "step").write_text(step)
    log = folder / "runs" / step / node / "healthcheck.log"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if log.exists() and "# exit " in log.read_text():
            (folder / "step").unlink(missing_ok=True)
            return log.read_text()
        time.sleep(0.2)
    (folder / "step").unlink(missing_ok=True)
    pytest.fail(f"{step}: healthcheck.sh did not finish within {WAIT_S} s: "
                f"{log.read_text()[-2000:] if log.exists() else 'no log'}")


def _node(node: str, wait_for: str | None = None) -> dict[str, str]:
    """scontrol's view of the node (State, Reason, Comment), once `wait_for` is in its state (slurmctld applies
    an update a moment later)."""
    deadline = time.monotonic() + 20
    while True:
        text = _slurm("scontrol", "show", "node", node, "--oneliner")
        fields = dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", text))
        if wait_for is None or wait_for in fields.get("State", "") or time.monotonic() > deadline:
            return fields
        time.sleep(0.5)


def _events(folder: Path, node: str) -> list[str]:
    return [e.event for e in history.load(folder / "state", node)]


def test_a_node_comes_back_only_by_proof_and_a_lemon_is_held(cluster):
    taken_out = _step(cluster, "n2", broken=True)
    assert "this node taken out of service (n2)" in taken_out and "# exit 1" in taken_out, taken_out[-3000:]
    n2 = _node("n2", "DRAIN")
    assert "DRAIN" in n2["State"] and n2["Reason"].startswith(TAKEN), n2
    assert _events(cluster, "n2") == [history.TAKEN_OUT]

    still_broken = _step(cluster, "n2", broken=True)
    assert "re-proof with --reproof-tiers full" in still_broken, still_broken[-3000:]
    assert "this node stays out of service; exit 86" in still_broken and "# exit 1" in still_broken
    n2 = _node("n2", "DRAIN")
    assert "DRAIN" in n2["State"] and re.match(r"stackproof: re-proof \S+ failed: collectives::all_reduce",
                                               n2["Reason"]), n2
    assert _events(cluster, "n2")[-2:] == [history.REPROVED, history.KEPT_OUT]
    # The wrong sums are the link's (interconnect, isolate): the remedy the policy table gives, in the log and the
    # run's own remedy lines.
    steps = policy.remedy_words(policy.remedy("interconnect", "isolate"))
    assert f"remedy: {steps}" in still_broken and f"[interconnect, isolate]: {steps}" in still_broken, \
        still_broken[-3000:]

    # Detached (the default: slurmd kills a HealthCheckProgram at 60 s, a full + burn re-proof takes minutes):
    # the health check starts it in its own session and returns; the re-proof resumes the node when it passes.
    started = _step(cluster, "n2", broken=False, extra="")
    assert "re-proof started in the background (pid" in started and "# exit 1" in started, started[-3000:]
    log = Path(re.search(r"its log (\S+)\)", started).group(1))
    deadline = time.monotonic() + WAIT_S
    while _events(cluster, "n2")[-1] != history.RETURNED and time.monotonic() < deadline:
        time.sleep(0.2)
    repaired = log.read_text()
    assert "this node is back in service; exit 0" in repaired, repaired[-3000:]
    run = re.search(r"re-proof \(full\) run (\S+): exit 0", repaired).group(1)
    n2 = _node("n2", "IDLE")
    assert "DRAIN" not in n2["State"] and n2["Comment"].startswith(f"stackproof: returned by re-proof {run}"), n2
    assert _events(cluster, "n2")[-2:] == [history.REPROVED, history.RETURNED]
    copy = json.loads(max(cluster.glob(f"runs/*/n2/runs/{run}/{history.RUN_COPY}")).read_text())
    assert copy["out_of_service"] is False and copy["events"][-1]["event"] == history.RETURNED

    again = _step(cluster, "n2", broken=True)
    assert "a lemon: taken out 2 times in 7 days" in again, again[-3000:]
    n2 = _node("n2", "DRAIN")
    assert n2["Reason"].startswith("stackproof: needs service: taken out 2 times in 7 days"), n2
    assert n2["Reason"].count("needs service") == 1, n2
    prom = max(cluster.glob(f"runs/*/n2/runs/*/{history.METRICS_FILE}"), key=lambda p: p.stat().st_mtime)
    assert f'{history.NEEDS_SERVICE}{{node="n2"}} 1' in prom.read_text(), prom.read_text()

    held = _step(cluster, "n2", broken=False)
    assert "re-proof (full) run" in held and ": exit 0 (" in held, held[-3000:]
    assert "stays out of service; exit 86" in held and "# exit 1" in held, held[-3000:]
    n2 = _node("n2", "DRAIN")
    assert n2["Reason"].startswith("stackproof: needs service: taken out 2 times in 7 days"), n2
    assert n2["Reason"].count("needs service") == 1, n2
    assert _events(cluster, "n2")[-3:] == [history.HELD, history.REPROVED, history.HELD]

    # A person services the lemon and resumes it: the next check finds it in service, records it serviced, and
    # its count starts again (the metric back to 0).
    _slurm("scontrol", "update", "nodename=n2", "state=resume")
    _node("n2", "IDLE")
    serviced = _step(cluster, "n2", broken=False)
    assert "this node stays in service; exit 0" in serviced, serviced[-3000:]
    assert _events(cluster, "n2")[-1] == history.SERVICED
    prom = max(cluster.glob(f"runs/*/n2/runs/*/{history.METRICS_FILE}"), key=lambda p: p.stat().st_mtime)
    assert f'{history.NEEDS_SERVICE}{{node="n2"}} 0' in prom.read_text(), prom.read_text()


def test_a_node_an_operator_drained_is_never_checked_nor_resumed(cluster):
    # n1 taken out by stackproof; the fault removed, its detached re-proof starts; an operator drains it for a
    # reason of their own while the re-proof runs: the passing re-proof leaves it as it is.
    assert "this node taken out of service (n1)" in _step(cluster, "n1", broken=True)
    started = _step(cluster, "n1", broken=False, extra="")
    log = Path(re.search(r"its log (\S+)\)", started).group(1))
    deadline = time.monotonic() + WAIT_S
    while "re-proof with --reproof-tiers" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, started
        time.sleep(0.2)
    _slurm("scontrol", "update", "nodename=n1", "state=drain", "reason=operator: replacing a PSU")
    while "left as it is" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    said = log.read_text()
    assert "re-proof (full) run" in said and ": exit 0 (" in said, said[-3000:]
    assert "during the re-proof this node became out of service for another reason" in said, said[-3000:]
    assert "scontrol update nodename=n1 state=resume" not in said, said[-3000:]
    assert _node("n1")["Reason"].startswith("operator: replacing a PSU")
    try:
        log = _step(cluster, "n1", broken=False)
        assert "out of service for another reason" in log and "left as it is" in log, log[-3000:]
        assert "validate not run; this node stays in service; exit 0" in log and "run: scontrol" not in log, log
        n1 = _node("n1")
        assert "DRAIN" in n1["State"] and n1["Reason"].startswith("operator: replacing a PSU"), n1
        assert _events(cluster, "n1")[-1] == history.REPROVED  # the operator's drain: nothing of stackproof's
    finally:
        _slurm("scontrol", "update", "nodename=n1", "state=resume", check=False)
    assert int(Healthcheck.TAKEN_OUT) == 86
