"""The warm start (stackproof/run/warm.py, `stackproof warm-agent`) on CPU ranks (gloo), real processes throughout:
a healthcheck served by the agent reaches the verdict and record a cold start reaches, with the fault beneath
torch (tests/fixtures/broken_allreduce) and without; with no agent the run starts cold and says so; a second run
is served while one runs; an agent killed mid-run takes its ranks with it, and the next healthcheck runs cold;
an agent whose start-up touched CUDA refuses to serve; the ranks were forked by the agent, torch already loaded.
The speed is printed by benchmarks/startup.py."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stackproof.errors import Exit, Healthcheck
from stackproof.run import warm
from stackproof.run.phases import RUN_PHASES

TAKEN_OUT = int(Healthcheck.TAKEN_OUT)
REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
BROKEN_ALLREDUCE = REPO / "tests" / "fixtures" / "broken_allreduce"
ALLREDUCE = ["--expect-gpus", "0", "--nproc", "2", "--tier", "full", "-k", "all_reduce and sum-float32",
             "--max-check-bytes", "64K", "--timeout", "60", "--deadline", "200"]
# On the ranks' PYTHONPATH: each rank says, at its start, its parent and whether torch was loaded already; with
# WARM_TEST_SLOW_S set in its environment it waits that long before it joins the world (a run that stays busy);
# with WARM_TEST_GATE, until that file exists (at most 120 s): busy exactly until the test lets it go.
# WARM_TEST_ALSO: another sitecustomize to run too (the broken all_reduce), as only one module of the name loads.
SPY = textwrap.dedent("""
    import json, os, sys, time
    if os.environ.get("STACKPROOF_LAUNCHED") and os.environ.get("RANK") is not None:
        with open(os.environ["WARM_TEST_SPY"], "a") as out:
            out.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "rank": os.environ["RANK"],
                                  "torch": "torch" in sys.modules}) + "\\n")
        if os.environ.get("WARM_TEST_SLOW_S"):
            time.sleep(float(os.environ["WARM_TEST_SLOW_S"]))
        if os.environ.get("WARM_TEST_GATE"):
            _until = time.monotonic() + 120
            while not os.path.exists(os.environ["WARM_TEST_GATE"]) and time.monotonic() < _until:
                time.sleep(0.05)
    if os.environ.get("WARM_TEST_ALSO"):
        with open(os.environ["WARM_TEST_ALSO"]) as also:
            exec(compile(also.read(), os.environ["WARM_TEST_ALSO"], "exec"))
""")


def _env(tmp_path: Path, broken: bool = False, **extra: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SPY)
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM", "STACKPROOF_", "PET_", "CUDA_", "NVIDIA_", "WARM_TEST_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTEST_ADDOPTS")}
    also = {"WARM_TEST_ALSO": str(BROKEN_ALLREDUCE / "sitecustomize.py")} if broken else {}
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, [site, REPO])),
            "WARM_TEST_SPY": str(tmp_path / "spy.jsonl"), **also, **extra}


class Agent:
    def __init__(self, tmp_path: Path, env: dict[str, str], sitecustomize: str | None = None):
        self.path = str(tmp_path / "run" / "warm.sock")
        self.proc = subprocess.Popen([PYTHON, "-m", "stackproof", "warm-agent", "--socket", self.path],
                                     env={**env, "STACKPROOF_WARM_SOCKET": "unused-the-flag-wins"}, cwd=tmp_path,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.ready = self.proc.stdout.readline()  # its first line, once torch is imported and it listens

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[1]


@pytest.fixture
def agent(tmp_path):
    started = Agent(tmp_path, _env(tmp_path))
    assert "torch" in started.ready and "listening on" in started.ready, started.ready + started.stop()
    yield started
    started.stop()


def _healthcheck(tmp_path: Path, reports: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n2",
                           "--reports", str(tmp_path / reports), "--keep-runs", "0", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)


def _record(tmp_path: Path, reports: str) -> dict:
    return json.loads((tmp_path / reports / "report.json").read_text())


def _evidence(record: dict) -> list[tuple]:
    """What the verdict rests on, without the times: each check's outcome, failed ranks, message and findings."""
    return [(c["nodeid"], c["outcome"], c["failed_ranks"], c["message"],
             [(f["check"], f["category"], f["severity"], f["rank"], f["node"]) for f in c.get("findings", [])])
            for c in record["checks"]]


def _alive(pid: int) -> bool:
    """Running (a zombie is gone: only its exit status waits for a parent that reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _spied(tmp_path: Path) -> list[dict]:
    path = tmp_path / "spy.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_warm_healthcheck_reaches_the_cold_ones_verdict_and_record(tmp_path, agent):
    """The broken all_reduce (beneath torch, on the ranks' PYTHONPATH) takes the node out warm as cold; the ranks
    were forked by the agent with torch loaded, and every rank's record and exit is kept."""
    env = _env(tmp_path, True, STACKPROOF_WARM_SOCKET=agent.path)
    runs = {how: _healthcheck(tmp_path, how, *ALLREDUCE, *(("--cold",) if how == "cold" else ()), env=env)
            for how in ("warm", "cold")}
    for how, proc in runs.items():
        out = proc.stdout + proc.stderr
        assert proc.returncode == TAKEN_OUT, f"{how}: {out[-4000:]}"
        assert "collectives::all_reduce[sum-float32]  FAIL" in out, out[-4000:]
        assert "delivered intact (index 0: 5.0), found index 0: 6.0" in out, out[-4000:]
        assert f"this node would be taken (--scheduler none) out of service (n2); exit {TAKEN_OUT}" in out
    assert f"warm start: ranks forked by the warm agent (pid {agent.proc.pid}) at {agent.path}" in runs["warm"].stdout
    assert "cold start (--cold)" in runs["cold"].stdout
    warm_record, cold_record = _record(tmp_path, "warm"), _record(tmp_path, "cold")
    assert _evidence(warm_record) == _evidence(cold_record) and warm_record["checks"], _evidence(warm_record)
    for record in (warm_record, cold_record):
        assert record["complete"] and record["exit_code"] == Exit.FAILED and len(record["ranks"]) == 2
        assert sorted(set(record["context"]["phases"])) == sorted({"launcher_started", "ranks", *RUN_PHASES})
    spied = _spied(tmp_path)
    forked = [s for s in spied if s["ppid"] == agent.proc.pid]
    assert sorted(s["rank"] for s in forked) == ["0", "1"] and all(s["torch"] for s in forked), spied
    assert len(spied) == 4 and not any(s["torch"] for s in spied if s not in forked), spied
    assert warm.status(agent.path)["ranks"] == [], "the agent still holds a rank after the run"


def test_without_an_agent_the_healthcheck_starts_cold_and_says_so(tmp_path):
    missing = tmp_path / "no-agent.sock"
    proc = _healthcheck(tmp_path, "r", *ALLREDUCE, env=_env(tmp_path, STACKPROOF_WARM_SOCKET=str(missing)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"cold start: no warm agent at {missing} (No such file or directory)" in proc.stdout
    assert "validate exit 0 (every check ran and passed); this node stays in service; exit 0" in proc.stdout


def test_the_socket_is_only_for_the_agents_user_and_group_and_an_idle_agent_has_no_cuda(tmp_path, agent):
    assert stat.S_IMODE(os.stat(agent.path).st_mode) == 0o660
    assert stat.S_ISSOCK(os.stat(agent.path).st_mode)
    state = warm.status(agent.path)
    assert state["pid"] == agent.proc.pid and state["cuda_initialized"] is False and state["ranks"] == []
    assert state["cuda_driver_loaded"] is False


# What a library on the agent's path could do at import: initialise torch.cuda, or load the CUDA driver (here a
# stand-in: the C math library under libcuda's name, so no GPU is needed to see the agent refuse).
TOUCHES_CUDA = {
    "torch.cuda initialised": "import torch\ntorch.cuda.is_initialized = lambda: True\n",
    "libcuda loaded": textwrap.dedent("""
        import ctypes, os, shutil
        _fake = os.path.join(os.path.dirname(__file__), "libcuda.so.1")
        shutil.copy(next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                                     "/usr/lib64/libm.so.6", "/lib64/libm.so.6") if os.path.exists(p)), _fake)
        ctypes.CDLL(_fake)
    """),
}


@pytest.mark.parametrize("touch", list(TOUCHES_CUDA))
def test_an_agent_whose_start_up_touched_cuda_refuses_to_serve(tmp_path, touch):
    """CUDA touched in the agent before any fork (from outside: a sitecustomize): forked ranks would share its
    state, so it exits 2 saying why, and leaves no socket behind."""
    touched = tmp_path / "touched"
    touched.mkdir()
    (touched / "sitecustomize.py").write_text(TOUCHES_CUDA[touch])
    env = _env(tmp_path)
    env["PYTHONPATH"] = f"{touched}{os.pathsep}{REPO}"
    started = Agent(tmp_path, env)
    err = started.stop()
    assert started.proc.returncode == Exit.USAGE, err
    assert "CUDA was initialised in the warm agent" in err and "fix:" in err and "Traceback" not in err
    assert not Path(started.path).exists()


def test_a_second_run_is_served_while_one_runs(tmp_path, agent):
    env = _env(tmp_path, True, STACKPROOF_WARM_SOCKET=agent.path)
    command = [PYTHON, "-m", "stackproof", "validate", "--expect-gpus", "0", "--tier", "fast", "-k", "dev_shm"]
    gate = tmp_path / "gate"  # the first run's ranks wait for it: busy until the second run is done
    first = subprocess.Popen([*command, "--reports", str(tmp_path / "first")], cwd=tmp_path, text=True,
                             env={**env, "WARM_TEST_GATE": str(gate)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(warm.status(agent.path)["ranks"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(warm.status(agent.path)["ranks"]) == 2, "the first run's ranks never started"
    second = subprocess.run([*command, "--reports", str(tmp_path / "second")], cwd=tmp_path, text=True, env=env,
                            capture_output=True, timeout=120)
    still_running = first.poll() is None
    gate.touch()
    out, _ = first.communicate(timeout=120)
    assert second.returncode == 0 and "warm start" in second.stdout, second.stdout[-3000:] + second.stderr[-3000:]
    assert still_running, "the second run did not overlap the first"
    assert first.returncode == 0 and "warm start" in out, out[-3000:]
    assert _record(tmp_path, "first")["complete"] and _record(tmp_path, "second")["complete"]


def test_an_agent_killed_mid_run_takes_its_ranks_and_the_next_healthcheck_runs_cold(tmp_path, agent):
    env = _env(tmp_path, True, STACKPROOF_WARM_SOCKET=agent.path)
    clean_env = {k: v for k, v in env.items() if k != "WARM_TEST_ALSO"}
    during = subprocess.Popen([PYTHON, "-m", "stackproof", "healthcheck", "--scheduler", "none", "--node", "n2",
                               "--reports", str(tmp_path / "during"), "--keep-runs", "0", *ALLREDUCE],
                              env={**env, "WARM_TEST_SLOW_S": "60"}, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while len(warm.status(agent.path)["ranks"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = warm.status(agent.path)["ranks"]
    assert len(ranks) == 2
    agent.proc.kill()
    out, _ = during.communicate(timeout=120)
    assert during.returncode == 0, out[-4000:]  # not judged: the node stays in service
    assert "validate exit 4" in out and "this node stays in service; exit 0" in out, out[-4000:]
    time.sleep(0.5)
    assert not [pid for pid in ranks if _alive(pid)], "a rank outlived its agent"
    after = _healthcheck(tmp_path, "after", *ALLREDUCE, env={**clean_env, "STACKPROOF_WARM_SOCKET": agent.path})
    assert after.returncode == 0, (after.stdout + after.stderr)[-4000:]
    assert f"cold start: no warm agent at {agent.path} (Connection refused)" in after.stdout
    assert "validate exit 0 (every check ran and passed); this node stays in service; exit 0" in after.stdout


def test_a_launcher_killed_mid_run_takes_its_warm_ranks_with_it(tmp_path, agent):
    """The launcher dies (SIGKILL: no handler runs): its connections drop, and the agent stops the ranks."""
    env = _env(tmp_path, STACKPROOF_WARM_SOCKET=agent.path, WARM_TEST_SLOW_S="120")
    launcher = subprocess.Popen([PYTHON, "-m", "stackproof", "validate", "--expect-gpus", "0", "--tier", "fast",
                                 "--reports", str(tmp_path / "r")], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(warm.status(agent.path)["ranks"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = warm.status(agent.path)["ranks"]
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while warm.status(agent.path)["ranks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert warm.status(agent.path)["ranks"] == [] and not [pid for pid in ranks if _alive(pid)]


def test_a_launcher_of_another_import_path_is_started_cold_and_told_why(tmp_path, agent):
    """A warm rank must run the code a cold one would import: another PYTHONPATH (here one more folder on it) is
    refused, and the run starts cold, passing, with the reason on its line."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _env(tmp_path, STACKPROOF_WARM_SOCKET=agent.path)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{elsewhere}"
    proc = subprocess.run([PYTHON, "-m", "stackproof", "validate", "--expect-gpus", "0", "--tier", "fast", "-k",
                           "dev_shm", "--reports", str(tmp_path / "r")], env=env, cwd=tmp_path, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"cold start: the warm agent at {agent.path} runs another pythonpath; fix: restart it from the " \
           "launcher's environment" in proc.stdout, proc.stdout[-3000:]
    assert not [s for s in _spied(tmp_path) if s["ppid"] == agent.proc.pid]


def test_an_agent_of_another_protocol_is_not_asked_and_the_run_starts_cold(tmp_path):
    """An agent started before an upgrade of the same checkout speaks the protocol it loaded (here the one before
    the leaving pipe): the launcher starts cold, passing, and says to restart it."""
    older = tmp_path / "older_protocol.py"
    older.write_text("from stackproof.run import warm\nwarm.PROTOCOL = '1'\n")
    old = Agent(tmp_path, _env(tmp_path, WARM_TEST_ALSO=str(older)))
    try:
        assert "listening on" in old.ready, old.ready + old.stop()
        proc = subprocess.run([PYTHON, "-m", "stackproof", "validate", "--expect-gpus", "0", "--tier", "fast", "-k",
                               "dev_shm", "--reports", str(tmp_path / "r")], cwd=tmp_path, text=True,
                              env=_env(tmp_path, STACKPROOF_WARM_SOCKET=old.path), capture_output=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"cold start: the warm agent at {old.path} runs another protocol; fix: restart it" in proc.stdout, \
            proc.stdout[-3000:]
        assert not [s for s in _spied(tmp_path) if s["ppid"] == old.proc.pid]
    finally:
        old.stop()
