"""How validate (and bench resnet) start their ranks on one node: no torch in the launcher, no torchrun agent in
between, each step of the start-up recorded in report.json, bad launcher variables refused at once, and every
rank's processes stopped when the run times out. The speed itself is printed by benchmarks/startup.py."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stackproof.errors import Exit
from stackproof.run import local_ranks
from stackproof.run.phases import RANK_PHASES

ROOT = Path(__file__).resolve().parents[1]
# Printed by every Python process the run starts, when it exits normally (the launcher) or starts (all).
SPY = textwrap.dedent("""
    import atexit, json, os, sys
    _log = os.environ.get("STARTUP_SPY_LOG")
    if _log:
        def _write(event):
            with open("/proc/self/cmdline") as cmdline:
                argv = cmdline.read().split("\\0")
            with open(_log, "a") as out:
                out.write(json.dumps({"event": event, "pid": os.getpid(), "argv": " ".join(argv),
                                      "rank": os.environ.get("RANK"), "torch": "torch" in sys.modules}) + "\\n")
        _write("start")
        atexit.register(_write, "exit")
""")
# Breaks torch.distributed beneath the ranks: joining the world never returns, and the rank has started a child
# of its own first (as a DataLoader or compile worker would) that holds on as long as nobody stops it.
HANG = textwrap.dedent("""
    import os, subprocess, sys
    _marker = os.environ.get("STARTUP_HANG_MARKER")
    if _marker and os.environ.get("RANK"):
        import torch.distributed as dist

        def _hang(*args, **kwargs):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", _marker])
            import time
            time.sleep(600)

        dist.init_process_group = _hang
        dist.rendezvous = lambda *args, **kwargs: iter([_hang()])
""")


def _env(tmp_path: Path, sitecustomize: str, **extra: str) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(sitecustomize)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NVIDIA_VISIBLE_DEVICES", "STACKPROOF_REPORTS", "PYTEST_ADDOPTS", "RANK", "WORLD_SIZE")
           and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _processes_with(marker: str, where: str = "cmdline") -> list[int]:
    """PIDs whose /proc/PID/<where> (cmdline, or environ: every process a run starts inherits it) holds marker."""
    pids = []
    for path in Path("/proc").glob(f"[0-9]*/{where}"):
        try:
            if marker.encode() in path.read_bytes():
                pids.append(int(path.parent.name))
        except OSError:
            continue
    return [pid for pid in pids if pid != os.getpid()]


def _left_after_kill(marker: str, where: str = "cmdline", within_s: float = 5.0) -> list[int]:
    """_processes_with, once the processes the run killed have had `within_s` to die: SIGKILL reaches a rank's
    children asynchronously (under two busy workers one was still there the moment the run returned), while a
    process left running (they all sleep for minutes) is still there after it."""
    deadline = time.monotonic() + within_s
    while (left := _processes_with(marker, where)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_the_launcher_starts_the_ranks_itself_without_torch_and_records_the_phases(tmp_path):
    log, reports = tmp_path / "spy.jsonl", tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--tier", "fast", "--reports", str(reports)],
                          capture_output=True, text=True, timeout=300,
                          env=_env(tmp_path, SPY, STARTUP_SPY_LOG=str(log)))
    assert proc.returncode == Exit.OK, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    started = [e for e in events if e["event"] == "start" and "stackproof" in e["argv"]]
    # The launcher and its two ranks, nothing between them (torchrun's agent imports torch before any rank).
    assert sorted(e["rank"] or "launcher" for e in started) == ["0", "1", "launcher"], started
    assert not any("torch.distributed.run" in e["argv"] or "stackproof.run.agent" in e["argv"] for e in started)
    (launcher_exit,) = [e for e in events if e["event"] == "exit" and e["rank"] is None]
    assert launcher_exit["torch"] is False, "the launcher imported torch"

    phases = json.loads((reports / "report.json").read_text())["context"]["phases"]
    assert len(phases["ranks"]) == 2
    for rank in phases["ranks"]:
        times = [phases["launcher_started"], *(rank[name] for name in RANK_PHASES), phases["checks_started"],
                 phases["checks_done"], phases["ranks_done"], phases["ranks_exited"]]
        assert times == sorted(times), rank
    assert phases["checks_done"] - phases["launcher_started"] < 300


@pytest.mark.parametrize(("env", "words"), [
    ({"RANK": "junk"}, "expected whole numbers, found RANK='junk'"),
    ({"RANK": "0"}, "RANK=0 is set, so this process is one rank of a launcher's world, but WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT are missing"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK=2: expected 0..1"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_PROCID=0 and SLURM_NTASKS=2 are set but this process is not "
                                                 "a task of srun"),
    # Issue 36 item 12: these waited out the rendezvous, silently.
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"},
     "SLURM_PROCID=5: expected 0..1 (SLURM_NTASKS=2)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc", "SLURM_STEP_ID": "0"},
     "expected whole numbers, found SLURM_NTASKS='abc'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[1-2"},
     "SLURM_JOB_NODELIST='n[1-2': expected Slurm's node list"),
    ({"SLURM_JOB_ID": "abc"}, "expected whole numbers, found SLURM_JOB_ID='abc'"),
], ids=["rank-junk", "rank-alone", "rank-outside-world", "batch-script-without-srun", "slurm-task-outside-step",
        "slurm-ntasks-junk", "slurm-nodelist-unclosed", "slurm-job-id-junk"])
def test_leftover_launcher_variables_are_bad_input_at_once(tmp_path, env, words):
    begin = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=60, env=_env(tmp_path, "", **env))
    assert proc.returncode == Exit.USAGE, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert words in proc.stderr and "fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "report.json").exists(), "nothing may run on bad input"
    assert time.monotonic() - begin < 30


def _run_until_hung(command: list[str], env: dict[str, str], marker: str) -> tuple[subprocess.Popen, str, str]:
    """Run `command`; check that both ranks reached the broken library (their children are up) before it ends."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while len(_processes_with(marker)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = len(_processes_with(marker))
    out, err = proc.communicate(timeout=120)
    left = _left_after_kill(f"STARTUP_HANG_MARKER={marker}", "environ")
    assert left == [], f"ranks, or processes they started, outlived the run: {left}"
    assert hung == 2, f"expected both ranks to hang in torch.distributed, found {hung}: {out[-2000:]}{err[-2000:]}"
    return proc, out, err


def test_run_timeout_stops_every_rank_and_what_it_started(tmp_path):
    marker = f"stackproof-hang-{os.getpid()}-{time.monotonic_ns()}"
    proc, out, err = _run_until_hung(
        [sys.executable, "-m", "stackproof", "validate", "--tier", "fast", "--reports", str(tmp_path / "reports"),
         "--timeout", "10", "--run-timeout", "20"], _env(tmp_path, HANG, STARTUP_HANG_MARKER=marker), marker)
    assert proc.returncode == Exit.INCOMPLETE, out[-3000:] + err[-3000:]
    assert "the run exceeded --run-timeout 20 s and was stopped" in out


def test_bench_timeout_stops_every_rank_and_what_it_started(tmp_path):
    """Item 21 of issue 20: bench resnet's ranks are started the launcher's way, so a timeout leaves nothing behind
    (subprocess.run(timeout=) on torchrun killed torchrun alone)."""
    marker = f"stackproof-hang-{os.getpid()}-{time.monotonic_ns()}"
    proc, out, err = _run_until_hung(
        [sys.executable, "-m", "stackproof", "bench", "resnet", "--nproc", "2", "--timeout", "20", "--steps", "1",
         "--warmup", "1"], _env(tmp_path, HANG, STARTUP_HANG_MARKER=marker), marker)
    assert proc.returncode == Exit.FAILED, out[-3000:] + err[-3000:]
    assert "expected to finish within --timeout 20 s, found it still running" in err


# Slows one rank's read of rank 0's answers, beneath the suite: rank 0 is done first and must not take the store
# (it hosts it) away before this rank has read the verdict.
SLOW_READER = textwrap.dedent("""
    import os, time
    if os.environ.get("STARTUP_SLOW_READER") == os.environ.get("RANK"):
        import torch.distributed as dist

        _get = dist.PrefixStore.get

        def _slow_get(self, key):
            if key.endswith("answer"):
                time.sleep(2)
            return _get(self, key)

        dist.PrefixStore.get = _slow_get
""")


def test_rank_0_hosting_the_store_waits_until_every_rank_has_read_the_verdict(tmp_path):
    """Ranks started by a launcher that leaves the store to rank 0 (srun, a PyTorchJob without torchrun): each rank
    exits with the run's verdict, also the one that reads it last."""
    port = local_ranks.free_port()
    env = _env(tmp_path, SLOW_READER, STARTUP_SLOW_READER="1")
    procs = [subprocess.Popen([sys.executable, "-m", "stackproof", "validate", "--reports", str(tmp_path / "r"), "-k",
                               "dev_shm", "--expect-gpus", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=local_ranks.rank_env(rank, 2, port, env)) for rank in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [Exit.OK, Exit.OK], outputs[1][-3000:]


def test_ranks_that_refuse_their_input_make_it_bad_input_not_a_dead_rank(tmp_path):
    """pytest options after -- that pytest rejects: every rank says so and exits 2; the run is bad input (exit 2),
    not "rank 0 exited with code 2" (exit 4)."""
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(tmp_path / "r"), "-k",
                           "dev_shm", "--", "--no-such-pytest-option"], capture_output=True, text=True, timeout=300,
                          env=_env(tmp_path, ""))
    assert proc.returncode == Exit.USAGE, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pytest rejected its arguments ('--no-such-pytest-option',)" in proc.stderr
    assert "# Verdict: FAILED (exit code 2: bad input" in proc.stdout


# A rank whose record is complete says so, then its teardown hangs (as a driver's teardown of a CUDA context can),
# with a child of its own holding on too.
SAYS_IT_LEAVES_THEN_HANGS = textwrap.dedent("""
    import os, subprocess, sys, time
    from stackproof.run import local_ranks

    local_ranks.take_leaving_fd()
    assert local_ranks.LEAVING_FD_ENV not in os.environ  # no process the rank starts sees the launcher's fd
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]])
    local_ranks.leaving(int(os.environ["RANK"]), int(sys.argv[2]))
    time.sleep(600)
""")


@pytest.mark.parametrize("code", [Exit.OK, Exit.FAILED])
def test_ranks_that_said_they_leave_are_stopped_when_their_teardown_hangs(tmp_path, monkeypatch, code):
    """The launcher waits LEAVE_WAIT_S for ranks whose records are complete, then stops them and what they started,
    keeping the exit code each said: a slow teardown is bounded, and nothing is left behind."""
    marker = f"stackproof-leaving-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setattr(local_ranks, "LEAVE_WAIT_S", 1.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    begin = time.time()
    outcome = local_ranks.run([sys.executable, "-c", SAYS_IT_LEAVES_THEN_HANGS, marker, str(int(code))], 2, env,
                              120.0)
    assert outcome.exit_code == code and not outcome.unkillable and not outcome.timed_out
    assert [f["rank"] for f in outcome.failures] == ([] if code == Exit.OK else [0, 1])
    assert begin < outcome.left["ranks_done"] < time.time()
    assert _left_after_kill(marker) == []


def test_a_cold_start_says_when_torch_has_no_compiled_bytecode(tmp_path, monkeypatch):
    """Issue 35: the H200 host's torch had no .pyc files and PYTHONDONTWRITEBYTECODE=1, so each rank compiled
    torch's modules at its start (its import 2.7 s, 1.65 s once compiled): a cold start says so, with the fix."""
    import importlib.machinery
    import importlib.util
    import py_compile

    from stackproof.run import launcher

    source = tmp_path / "site-packages" / "torch" / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text("")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: importlib.machinery.ModuleSpec(name, None, origin=str(source)))
    note = launcher.uncompiled_torch()
    assert "torch's modules have no compiled bytecode here" in note, note
    assert f"python -m compileall -q {tmp_path / 'site-packages'}" in note, note
    py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)))
    assert launcher.uncompiled_torch() == ""
