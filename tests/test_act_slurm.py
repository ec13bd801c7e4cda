"""scripts/slurm/healthcheck.sh run by slurmd itself, on a real cluster of its own (scripts/ci/slurm-cluster.sh
with SLURM_CLUSTER_EXTRA_CONF: a HealthCheckProgram every few seconds and a Prolog), as root, CPU ranks.

slurmd gives these programs almost no environment, so slurm.conf names a site wrapper (as a site's
/etc/default/stackproof-healthcheck would) that points at this checkout and this test's scenario: which nodes
check, with which flags, and which nodes have a broken torch (tests/fixtures/broken_allreduce on their
PYTHONPATH: all_reduce returns wrong sums there, a hardware-classified check fails). The image fault is the
boundary the suite reads: an expected-versions file (--expect-file) that the running torch does not match.

Proof, the same as HealthCheckProgram and as the Prolog of a real job: an image fault on every node drains
nothing; a hardware fault on n2 drains n2 only; with --max-drained 1 and n1 already drained, a fault on n2 is
reported and not drained. The cluster is this module's: it is stopped at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from stackproof.act import breaker, decide, slurm
from stackproof.errors import Healthcheck

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else None
HEALTHCHECK = REPO / "scripts" / "slurm" / "healthcheck.sh"
CLUSTER = REPO / "scripts" / "ci" / "slurm-cluster.sh"
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
# One rank per node, two cheap checks: the pins (the image fault) and one exact all_reduce (the hardware fault).
CHECKS = "--expect-gpus 0 --nproc 1 --tier full --max-check-bytes 64K --timeout 20 --run-timeout 50"
SELECTION = "versions_match_the_promise or all_reduce and sum-float32"
WAIT_S = 150
NODES = ("n1", "n2")

WRAPPER = """#!/usr/bin/env bash
# The site's settings for slurmd's HealthCheckProgram and Prolog (this test's scenario decides who checks).
dir={dir}
mode=hc; [ -z "${{SLURM_JOB_ID:-}}" ] || mode=prolog
[ -f "$dir/scenario" ] && [ "$(cat "$dir/mode")" = "$mode" ] || exit 0
grep -qx "$SLURMD_NODENAME" "$dir/nodes" || exit 0
id="$(cat "$dir/scenario")"
mkdir -p "$dir/runs/$id" && mkdir "$dir/runs/$id/$SLURMD_NODENAME" 2>/dev/null || exit 0   # once per scenario
export STACKPROOF_PYTHON={python} STACKPROOF_REPO={repo} OMP_NUM_THREADS=1
export SLURM_CONF={conf}    # scontrol / sinfo must reach this cluster, not the host's default one
export STACKPROOF_HEALTHCHECK_REPORTS="$dir/runs/$id"
export STACKPROOF_HEALTHCHECK_ARGS="$(cat "$dir/args")"
[ ! -f "$dir/broken/$SLURMD_NODENAME" ] || export PYTHONPATH={broken}
# Every node counts before any drains (the race the breaker must survive): the breaker's first sinfo waits for all.
[ ! -f "$dir/barrier" ] || export PATH="$dir/shims:$PATH" STACKPROOF_TEST_BARRIER="$dir/runs/$id/counted" \
    STACKPROOF_TEST_BARRIER_N="$(cat "$dir/barrier")"
# A broken install: the site's python has no stackproof (and no checkout on its path).
[ ! -f "$dir/python" ] || {{ export STACKPROOF_PYTHON="$(cat "$dir/python")"; unset STACKPROOF_REPO; }}
exec bash {script} -k "{selection}"
"""


CONF = "/etc/slurm-act/slurm.conf"


SINFO_BARRIER = """#!/usr/bin/env bash
# The first sinfo of each node (the circuit breaker's count) answers only once every node of the scenario has
# its answer: every count is taken before any node drains.
barrier="$STACKPROOF_TEST_BARRIER"
if [ -z "$barrier" ] || [ -e "$barrier/$SLURMD_NODENAME" ]; then exec {sinfo} "$@"; fi
out="$({sinfo} "$@")"; rc=$?
mkdir -p "$barrier" && touch "$barrier/$SLURMD_NODENAME"
for _ in $(seq 150); do [ "$(ls "$barrier" | wc -l)" -ge "$STACKPROOF_TEST_BARRIER_N" ] && break; sleep 0.1; done
printf '%s\\n' "$out"
exit "$rc"
"""


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STACKPROOF_"))},
            "SLURM_CONF": CONF, "SLURM_CLUSTER_NAME": "stackproof-act",
            "SLURM_CLUSTER_PORT_BASE": "6917"}


def _slurm(*argv: str, timeout: float = 20, check: bool = True) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(), check=check).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A three-node cluster of its own whose slurmd run the site wrapper as HealthCheckProgram and Prolog."""
    if os.geteuid() != 0:
        message = "slurmd running healthcheck.sh needs root (scripts/ci/slurm-cluster.sh)"
        if os.environ.get("STACKPROOF_REQUIRE_SLURM") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_SLURM=1 but {message}")
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("act-slurm")
    folder.chmod(0o755)
    wrapper = folder / "site-healthcheck.sh"
    wrapper.write_text(WRAPPER.format(dir=folder, python=PYTHON or __import__("sys").executable, repo=REPO,
                                      broken=BROKEN_ALLREDUCE, script=HEALTHCHECK,
                                      selection=SELECTION, conf=CONF))
    wrapper.chmod(0o755)
    (folder / "shims").mkdir()
    shim = folder / "shims" / "sinfo"
    shim.write_text(SINFO_BARRIER.format(sinfo=__import__("shutil").which("sinfo") or "/usr/bin/sinfo"))
    shim.chmod(0o755)
    extra = (f"HealthCheckProgram={wrapper}\nHealthCheckInterval=5\nHealthCheckNodeState=ANY\n"
             f"Prolog={wrapper}\nPrologFlags=Alloc\nSchedulerParameters=nohold_on_prolog_fail")
    env = {**_env(), "SLURM_CLUSTER_EXTRA_CONF": extra, "SLURM_CLUSTER_WAIT_S": "90"}
    up = subprocess.run(["bash", str(CLUSTER)], capture_output=True, text=True, timeout=600, env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    yield folder
    _scenario(folder, None)
    subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120, env=env)


def _scenario(folder: Path, mode: str | None, *, nodes=NODES, broken=(), extra: str = "", checks: str = CHECKS,
              python: str | None = None, partition: str = "debug",
              barrier: bool = False) -> str:
    """Set what the next HealthCheckProgram / Prolog runs do; None: nothing (the programs exit at once)."""
    (folder / "scenario").unlink(missing_ok=True)
    for switch in ("python", "barrier"):
        (folder / switch).unlink(missing_ok=True)
    if mode is None:
        return ""
    if python:
        (folder / "python").write_text(python)
    if barrier:
        (folder / "barrier").write_text(str(len(nodes)))
    (folder / "broken").mkdir(exist_ok=True)
    for old in (folder / "broken").iterdir():
        old.unlink()
    for node in broken:
        (folder / "broken" / node).write_text("")
    (folder / "nodes").write_text("\n".join(nodes) + "\n")
    (folder / "args").write_text(f"{checks} {extra}")
    (folder / "mode").write_text(mode)
    scenario = f"{mode}-{time.monotonic_ns()}"
    (folder / "scenario").write_text(scenario)
    return scenario


def _finished(folder: Path, scenario: str, nodes=NODES) -> dict[str, str]:
    """Wait until healthcheck.sh logged its exit on every node of the scenario; node -> its log."""
    deadline = time.monotonic() + WAIT_S
    logs = {}
    while time.monotonic() < deadline:
        logs = {n: (folder / "runs" / scenario / n / "healthcheck.log") for n in nodes}
        if all(p.exists() and "# exit " in p.read_text() for p in logs.values()):
            _scenario(folder, None)
            return {n: p.read_text() for n, p in logs.items()}
        time.sleep(0.2)
    _scenario(folder, None)
    pytest.fail(f"{scenario}: healthcheck.sh did not finish on {nodes} within {WAIT_S} s: "
                f"{[(n, p.read_text()[-1500:] if p.exists() else 'no log') for n, p in logs.items()]}")


def _reasons() -> dict[str, str]:
    out = _slurm("sinfo", "--Node", "--noheader", "--format=%N|%E")
    return {n: r for n, _, r in (line.partition("|") for line in out.splitlines()) if r.strip() != "none"}


def _settled_reasons(want: set[str], wait_s: float = 20) -> dict[str, str]:
    """sinfo's reasons once the drained nodes are `want` (slurmctld applies an update a moment later)."""
    deadline = time.monotonic() + wait_s
    while set(reasons := _reasons()) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    return reasons


def _resume_all() -> None:
    for node in _reasons():
        _slurm("scontrol", "update", f"nodename={node}", "state=resume", check=False)


@pytest.fixture
def clean(cluster):
    _resume_all()
    yield cluster
    _scenario(cluster, None)
    _resume_all()


def _prolog_job(nodes, partition: str = "debug") -> subprocess.Popen:
    """A real job on `nodes`: slurmd runs the Prolog on each before the job starts (PrologFlags=Alloc), on every
    node at once."""
    return subprocess.Popen(["srun", f"--partition={partition}", f"--nodelist={','.join(nodes)}",
                             f"--nodes={len(nodes)}", "--time=3",
                             "--immediate=120", "--no-kill", "bash", "-c", "echo $SLURMD_NODENAME"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _run(folder: Path, mode: str, **kw) -> tuple[dict[str, str], tuple[int | None, str, str] | None]:
    """The scenario run by slurmd; (node -> healthcheck.log, the job's (exit, stdout, stderr) in a Prolog)."""
    nodes = kw.get("nodes", NODES)
    scenario = _scenario(folder, mode, **kw)
    job = _prolog_job(nodes, kw.get("partition", "debug")) if mode == "prolog" else None
    logs = _finished(folder, scenario, nodes)
    if job is None:
        return logs, None
    try:
        out, err = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate(timeout=20)
    return logs, (job.returncode, out, err)


@pytest.mark.parametrize("mode", ["hc", "prolog"])
def test_an_image_fault_drains_nothing_and_a_hardware_fault_drains_its_node(clean, tmp_path, mode):
    """One scenario, both proofs (each run costs half a minute here): the image promises another torch than it
    runs, on every node; n2's all_reduce is also broken. n1 (image fault only) stays in service, n2 is drained
    for its hardware fault, n3 (not in the job, not checked) is untouched."""
    pins = tmp_path / "expected.json"
    pins.write_text(json.dumps({"torch": "1.0.0"}))
    pins.chmod(0o644)
    logs, job = _run(clean, mode, broken=("n2",), extra=f"--expect-file {pins}")
    n1, n2 = logs["n1"], logs["n2"]
    assert "n1: alert: stackproof: pins::versions_match_the_promise rank 0" in n1, n1[-3000:]
    assert "stackproof ALERT: n1: alert" in n1 and "run: scontrol" not in n1, n1[-3000:]
    assert "this node stays in service; exit 0" in n1 and "# exit 0" in n1, n1[-3000:]
    reason = "stackproof: collectives::all_reduce[sum-float32] rank 0 (+1 more)"
    assert f"run: scontrol update nodename=n2 state=drain 'reason={reason}'" in n2, n2[-3000:]
    assert "# exit 1" in n2, n2[-3000:]
    reasons = _settled_reasons({"n2"})
    assert set(reasons) == {"n2"} and reasons["n2"] == reason, reasons
    if job is not None:  # the Prolog said 1 on n2: the job did not run there
        assert "n2" not in job[1].split(), job


@pytest.mark.parametrize("mode", ["hc", "prolog"])
def test_the_circuit_breaker_holds_a_drain_past_max_drained(clean, mode):
    _slurm("scontrol", "update", "nodename=n1", "state=drain", "reason=stackproof: an earlier fault")
    logs, job = _run(clean, mode, nodes=("n2",), broken=("n2",), extra="--max-drained 1")
    log = logs["n2"]
    assert "circuit breaker: 1 of 3 nodes out of service by stackproof (n1); --max-drained 1 allows 1" in log, \
        log[-3000:]
    assert "n2: alert (drain withheld: 1 of 3 nodes already out of service" in log, log[-3000:]
    assert "run: scontrol" not in log and "# exit 0" in log
    assert set(_reasons()) == {"n1"}, _reasons()
    if job is not None:
        assert job[0] == 0 and job[1].split() == ["n2"], job


def test_slurm_fleet_reads_the_live_sinfo(clean):
    """The breaker's count from this cluster's own sinfo: partitions make the pool, the reason prefix counts."""
    _slurm("scontrol", "update", "nodename=n3", "state=drain", f"reason={decide.PREFIX} x")
    _slurm("scontrol", "update", "nodename=n1", "state=drain", "reason=someone else's")
    out = _slurm(*slurm.FLEET)
    assert slurm.fleet(out, {"n2"}) == breaker.Fleet(frozenset({"n1", "n2", "n3"}), frozenset({"n3"}))
    assert shlex.join(slurm.FLEET).startswith("sinfo")


def test_healthcheck_started_by_srun_on_every_node_acts_as_each_nodes_launcher(clean, tmp_path):
    """`srun -N2 stackproof healthcheck`: each task has SLURM_PROCID / SLURM_NTASKS=2 (a rank of a 2-task step
    before), runs its own node's check, and n2 (broken all_reduce) is drained, n1 not; srun exits n2's code, the
    taken-out one (healthcheck itself, not healthcheck.sh, which would turn it into 1)."""
    script = (f'[ "$SLURMD_NODENAME" != n2 ] || export PYTHONPATH={BROKEN_ALLREDUCE}:$PYTHONPATH; '
              f'exec {PYTHON or __import__("sys").executable} -m stackproof healthcheck --scheduler slurm '
              f'--node "$SLURMD_NODENAME" --reports {tmp_path}/"$SLURMD_NODENAME" {CHECKS} -k "{SELECTION}"')
    proc = subprocess.run(["srun", "--nodelist=n1,n2", "--nodes=2", "--ntasks-per-node=1", "--time=3",
                           "--kill-on-bad-exit=0", f"--chdir={REPO}", "bash", "-c", script],
                          capture_output=True, text=True, timeout=WAIT_S,
                          env={**_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == Healthcheck.TAKEN_OUT, out[-4000:]
    ignored = [line for line in out.splitlines() if "runs as this node's launcher, not as a rank: ignoring" in line]
    assert len(ignored) == 2 and all("SLURM_PROCID" in x and "SLURM_NTASKS" in x for x in ignored), out[-4000:]
    assert "this node stays in service; exit 0" in out
    assert f"this node taken out of service (n2); exit {int(Healthcheck.TAKEN_OUT)}" in out
    assert set(_settled_reasons({"n2"})) == {"n2"}


# --- issue 25: a fault everywhere, nodes acting at once; a broken install ------------------------------------
TRIO = ("n1", "n2", "n3")
REASON = "stackproof: collectives::all_reduce[sum-float32] rank 0"


@pytest.mark.parametrize(("mode", "serialized"), [("prolog", "lock"), ("prolog", "recount"), ("hc", "recount")])
def test_a_fault_on_every_node_at_once_drains_at_most_max_drained(clean, mode, serialized):
    """Three healthchecks at once (a 3-node job's Prologs start together; the HealthCheckPrograms too), each with
    the same fault (all_reduce's sums wrong on every node, a bad driver rollout as the ranks see it: a drain) and
    --max-drained 1. Each counts 0 drained before any drains; unserialized, all three drained. With
    --breaker-lock they take turns; without it (every count held until all three have counted: a sinfo shim on
    PATH) the re-count in slurmctld's order resumes the two past the cap. Either way: one drained, two in
    service."""
    lock = f"--breaker-lock {clean / 'breaker.lock'}" if serialized == "lock" else ""
    # --deadline: three nodes' torch ranks share this 2-core host (slurmd's own limit is not the point here)
    logs, _ = _run(clean, mode, nodes=TRIO, broken=TRIO, partition="trio",
                   extra=f"--max-drained 1 --deadline 140 {lock}", barrier=serialized == "recount")
    assert all(REASON in log for log in logs.values()), logs
    if serialized == "recount":  # the race happened: every node counted none drained
        assert all("circuit breaker: 0 of 3 nodes out of service" in log for log in logs.values()), logs
    reasons = _settled_reasons({n for n in TRIO if "# exit 1" in logs[n]})
    drained = {n for n, r in reasons.items() if r.startswith(decide.PREFIX)}
    assert len(drained) == 1, (reasons, {n: log[-2500:] for n, log in logs.items()})
    (kept,) = drained
    assert "# exit 1" in logs[kept] and "taken out of service" in logs[kept]
    for node in set(TRIO) - drained:
        assert "this node stays in service (drain withheld:" in logs[node] and "# exit 0" in logs[node], logs[node]
    if serialized == "lock":
        assert all(f"circuit breaker: holding {clean / 'breaker.lock'}" in log for log in logs.values())
    else:  # the losers drained, counted again and resumed themselves
        resumed = [n for n in TRIO if "the re-count after draining found" in logs[n]]
        assert sorted(resumed) == sorted(set(TRIO) - drained), {n: log[-2500:] for n, log in logs.items()}


@pytest.mark.parametrize("mode", ["hc", "prolog"])
def test_a_broken_install_never_drains(clean, tmp_path, mode):
    """The site's python is a real venv without stackproof: `No module named stackproof` on every node. Nothing is
    drained (not by stackproof, not by Slurm's "Prolog error"), the job runs, and each node says BROKEN and
    counts it in stackproof-healthcheck.prom."""
    import venv

    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(bare)
    os.chmod(tmp_path, 0o755)
    logs, job = _run(clean, mode, python=str(bare / "bin" / "python"))
    for node, log in logs.items():
        assert "No module named stackproof" in log and "stackproof healthcheck: BROKEN" in log, log[-2000:]
        assert "# exit 0 (stackproof healthcheck exited 1)" in log, log[-2000:]
        metric = max(clean.glob(f"runs/{mode}-*/{node}/stackproof-healthcheck.prom"), key=lambda p: p.stat().st_mtime)
        assert 'stackproof_healthcheck_broken{reason="exit 1"} 1' in metric.read_text()
    assert _settled_reasons(set(), wait_s=3) == {}
    if job is not None:
        assert job[0] == 0 and sorted(job[1].split()) == sorted(NODES), job
