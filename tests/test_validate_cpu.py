"""The suite run for real on CPU: the launcher's own ranks, gloo, real worker processes. Includes runs that break
something on purpose, to prove the verdict turns red (and names the rank) when it should."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackproof.errors import Exit

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_INCOMPLETE = Exit.OK, Exit.FAILED, Exit.NO_GPU, Exit.INCOMPLETE

RUN_TIMEOUT_S = 600
# Small buffers: the exactness logic is the same at every size; CI time is not.
QUICK = ["--max-check-bytes", "64K", "--sweep-max", "256K"]


def validate(tmp_path, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NVIDIA_VISIBLE_DEVICES", "STACKPROOF_REPORTS", "PYTEST_ADDOPTS")}
    env.update(env_extra or {})
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports), *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    report = json.loads((reports / "report.json").read_text()) if (reports / "report.json").exists() else None
    return proc, report


def stackproof(*args, timeout=120):
    """Any stackproof command, its output captured."""
    return subprocess.run([sys.executable, "-m", "stackproof", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def checks(report, outcome):
    return {c["name"]: c for c in report["checks"] if c["outcome"] == outcome}


@pytest.mark.parametrize("nproc", [2])  # 8 ranks across two nodes: tests/test_launchers_slurm.py
def test_whole_suite_passes_on_cpu_ranks(tmp_path, nproc):
    proc, report = validate(tmp_path, "--nproc", str(nproc), *QUICK)
    assert proc.returncode == EXIT_OK, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report["verdict"] == "OK" and report["world"]["size"] == nproc
    ran = {c["name"].split("::")[0] for c in report["checks"] if c["outcome"] == "passed"}
    assert {"host", "pins", "collectives", "ddp_resnet"} <= ran
    skipped = checks(report, "skipped")
    assert all(c["message"] for c in skipped.values()), "every skip names its reason"
    assert (tmp_path / "reports" / "junit.xml").exists()
    assert_stdout_is_the_contract(proc.stdout, "OK")
    assert (tmp_path / "reports" / "logs" / f"rank{nproc - 1}.log").exists()
    assert "passed" in (tmp_path / "reports" / "logs" / "rank0.log").read_text()  # pytest's own words go there
    assert report["schema"] == "stackproof.report/2" and report["stackproof"] and report["created"]
    assert report["settings"]["nproc"] == nproc and report["world"]["size"] == nproc
    assert [r["rank"] for r in report["ranks"]] == list(range(nproc)) and len(report["nodes"]) == 1
    busbw = checks(report, "skipped")["bandwidth::all_reduce_busbw"]
    assert "no bar is derived without GPUs" in busbw["message"] and "threshold" not in busbw["figures"]
    # Issue 36 item 14: a CPU run printed only its header for minutes; rank 0 now says each module as it starts,
    # and how far along the run is (the module's first check's place among all), before the table of checks.
    lines = proc.stdout.splitlines()
    modules = [c["name"].split("::")[0] for c in report["checks"]]
    assert [line for line in lines if line.startswith("# [")] == [
        f"# [{i}/{len(modules)}] {module} ..." for i, module in enumerate(modules, 1)
        if i == 1 or modules[i - 2] != module], lines
    assert max(i for i, line in enumerate(lines) if line.startswith("# [")) < \
        min(i for i, line in enumerate(lines) if line.startswith("# check"))


def assert_stdout_is_the_contract(stdout: str, verdict: str) -> None:
    """nccl-tests' rule: data lines have no '#', every other line has one (an empty line is neither), and the last
    line is the verdict."""
    lines = stdout.splitlines()
    assert all(line.strip() for line in lines), [i for i, line in enumerate(lines) if not line.strip()]
    data = [line for line in lines if not line.startswith("#")]
    assert all(line.startswith("  ") for line in data), [line for line in data if not line.startswith("  ")]
    assert lines[-2].startswith("# Verdict: " + verdict) and lines[-1].startswith("# report: ")
    assert sum(line.startswith("# Verdict:") for line in lines) == 1


def test_wrong_all_reduce_on_one_rank_fails_and_names_it(tmp_path):
    proc, report = validate(tmp_path, "--inject-fault", "allreduce-add-one", "--fault-rank", "1",
                            "-k", "all_reduce and float32", *QUICK)
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:]
    failed = checks(report, "failed")
    assert "collectives::all_reduce[sum-float32]" in failed
    message = failed["collectives::all_reduce[sum-float32]"]["message"]
    assert "rank(s) [1]" in message and "rank 1: data through collective" in message
    assert "delivered intact (index 0: " in message and "found index 0: " in message
    assert "# Verdict: FAILED" in proc.stdout


def test_perturbed_gradients_on_one_rank_fail_the_ddp_checks(tmp_path):
    proc, report = validate(tmp_path, "--inject-fault", "perturb-grad", "-k", "ddp", *QUICK)
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:]
    failed = checks(report, "failed")
    assert "rank(s) [1]" in failed["ddp_resnet::gradients_are_identical_across_ranks"]["message"]
    assert "ddp_resnet::parameters_are_identical_after_the_step" in failed
    assert "ddp_resnet::sampler_shards_are_disjoint_and_cover_the_dataset" in checks(report, "passed")


def test_a_hung_rank_ends_the_run_naming_it(tmp_path):
    proc, report = validate(tmp_path, "--inject-fault", "hang", "--timeout", "5", "-k", "barrier")
    assert proc.returncode == EXIT_INCOMPLETE, proc.stdout[-3000:]
    assert report["exit_code"] == EXIT_INCOMPLETE
    assert "rank(s) [1]" in report["message"]


def test_expected_gpus_but_none_visible_exits_3(tmp_path):
    proc, report = validate(tmp_path, "--expect-gpus", "1")
    assert proc.returncode == EXIT_NO_GPU
    assert "no GPU visible" in proc.stdout and "--expect-gpus 0" in proc.stdout
    assert report["exit_code"] == EXIT_NO_GPU and report["verdict"] == "FAILED"


def test_a_container_that_asked_for_gpus_expects_them(tmp_path):
    proc, _ = validate(tmp_path, env_extra={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert proc.returncode == EXIT_NO_GPU
    assert "NVIDIA_VISIBLE_DEVICES=all" in proc.stdout


def test_pins_compared_with_an_expect_file(tmp_path):
    import torch

    right = {"torch": torch.__version__.split("+")[0], "cuda": torch.version.cuda,
             "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    (tmp_path / "right.json").write_text(json.dumps(right))
    proc, report = validate(tmp_path, "--expect-file", str(tmp_path / "right.json"), "-k", "pins", "--nproc", "1")
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    (tmp_path / "wrong.json").write_text(json.dumps({**right, "nccl": "2.0.1"}))
    proc, report = validate(tmp_path, "--expect-file", str(tmp_path / "wrong.json"), "-k", "pins", "--nproc", "1")
    assert proc.returncode == EXIT_FAILED
    message = checks(report, "failed")["pins::versions_match_the_promise"]["message"]
    assert "nccl: expected 2.0.1" in message and f"found {right['nccl']} loaded from" in message


def test_an_environment_drifted_from_its_lock_is_named_package_by_package(tmp_path):
    """The lock an expect file names (an image's /etc/stackproof/lock.txt), against what is installed: a lock that
    pins another pytest than the one running fails as the image's (software-pins), naming it; the true pins pass."""
    from importlib.metadata import version

    import torch

    right = {"torch": torch.__version__.split("+")[0]}
    installed = {"pytest": version("pytest"), "packaging": version("packaging")}
    for name, pins in (("right", installed), ("drifted", {**installed, "pytest": "1.0.0"})):
        (tmp_path / f"{name}.txt").write_text("# stackproof lock: image=current python=3.13 platform=x86_64\n"
                                              + "".join(f"{p}=={v}\n" for p, v in pins.items()))
        (tmp_path / f"{name}.json").write_text(json.dumps({**right, "lock": str(tmp_path / f"{name}.txt")}))
    proc, report = validate(tmp_path / "ok", "--expect-file", str(tmp_path / "right.json"), "-k", "lock",
                            "--nproc", "1")
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    proc, report = validate(tmp_path / "bad", "--expect-file", str(tmp_path / "drifted.json"), "-k", "lock",
                            "--nproc", "1")
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:]
    [finding] = checks(report, "failed")["pins::installed_packages_match_the_lock"]["findings"]
    assert (finding["category"], finding["severity"]) == ("software-pins", "triage"), finding
    assert finding["found"] == f"1 package(s) differ: pytest: lock 1.0.0, installed {installed['pytest']}", finding


def test_bad_flags_exit_2_before_anything_runs(tmp_path):
    proc, report = validate(tmp_path, "--timeout", "900", "--run-timeout", "60")
    assert proc.returncode == 2 and report is None
    assert "--timeout 900 must not exceed --run-timeout 60" in proc.stderr


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--inject-fault", "crash", "--fault-rank", "7"], {}, "--fault-rank 7: expected a rank of this run (0..1)"),
    (["--reports", "/proc/forbidden"], {}, "--reports /proc/forbidden: expected a folder this user"),
    ([], {"PYTEST_ADDOPTS": "--bogus"}, "PYTEST_ADDOPTS='--bogus' is set"),
    (["-k", "no_such_check"], {}, "-k 'no_such_check' selects none of the suite's checks"),
], ids=["fault-rank", "reports", "pytest-addopts", "k-matches-nothing"])
def test_bad_input_is_exit_2_in_one_line(tmp_path, args, env, words):
    cmd = [sys.executable, "-m", "stackproof", "validate", "--reports", str(tmp_path / "r"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**{k: v for k, v in os.environ.items() if k != "NVIDIA_VISIBLE_DEVICES"}, **env})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def _processes_with(marker: str) -> list[int]:
    """PIDs whose command line mentions `marker` (each run's reports path is unique, and every process of a
    run carries it: the launcher and its ranks)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "docker-stop"])
def test_a_signal_stops_every_rank(tmp_path, signum):
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if k != "NVIDIA_VISIBLE_DEVICES"}
    launcher = subprocess.Popen([sys.executable, "-m", "stackproof", "validate", "--reports", str(reports),
                                 "--inject-fault", "hang", "-k", "barrier or dev_shm"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (reports / "report.json").exists() and time.monotonic() < deadline:  # rank 0 knows the world
        time.sleep(0.5)
    time.sleep(3)  # both ranks are inside the barrier test now: rank 1 sleeps, rank 0 waits for it
    assert len(_processes_with(str(reports))) >= 3, "the launcher and both ranks should be running"
    launcher.send_signal(signum)
    assert launcher.wait(timeout=60) == Exit.INTERRUPTED
    time.sleep(1)
    assert _processes_with(str(reports)) == [], "ranks outlived the launcher"
    report = json.loads((reports / "report.json").read_text())
    assert (report["verdict"], report["exit_code"]) == ("INTERRUPTED", Exit.INTERRUPTED)
    assert f"interrupted by {signum.name}" in report["message"]
    assert 'errors="1"' in (reports / "junit.xml").read_text()


def test_a_dead_rank_ends_the_run_naming_it(tmp_path):
    proc, report = validate(tmp_path, "--inject-fault", "crash", "--timeout", "20", "-k", "barrier")
    assert proc.returncode == EXIT_INCOMPLETE, proc.stdout[-3000:]
    assert report["exit_code"] == EXIT_INCOMPLETE and report["verdict"] == "FAILED"
    host = report["ranks"][1]["node"]
    assert f"rank 1 on {host} exited with code 13" in report["message"]
    assert f"rank 1 on {host} exited with code 13" in proc.stdout
    assert_stdout_is_the_contract(proc.stdout, "FAILED")


def test_the_watchdog_locates_a_rank_stalled_outside_any_collective(tmp_path):
    """Rank 0 itself stalls: nobody can time out waiting for it in a sync it hosts, so the per-check watchdog
    (--check-timeout) must answer, as it does on GPUs where a NCCL wait may never return to Python."""
    proc, report = validate(tmp_path, "--inject-fault", "hang", "--fault-rank", "0", "--timeout", "10",
                            "--check-timeout", "8", "-k", "barrier")
    assert proc.returncode == EXIT_INCOMPLETE, proc.stdout[-3000:]
    meaning = report["message"]
    assert "did not finish within 8 s: rank(s) [0] stalled outside any collective (rank 0 at faults.py:" in meaning
    assert "rank(s) [1] were waiting for rank(s) [0] in a collective" in meaning
    assert "# Verdict: FAILED (exit code 4" in proc.stdout


def test_a_hang_leaves_every_thread_of_every_rank_in_its_own_log(tmp_path):
    """pytest captures a check's stderr, and a rank that is stopped takes its capture with it: the stacks go
    into each rank's log itself. The stalled rank's shows where it is stuck (the hang fault's sleep), rank 0's
    the wait it hosts, both with the watchdog's own thread beside the main thread."""
    proc, _ = validate(tmp_path, "--expect-gpus", "0", "-k", "collectives and barrier", "--inject-fault", "hang",
                       "--timeout", "5", "--check-timeout", "8", "--run-timeout", "60")
    assert proc.returncode == EXIT_INCOMPLETE, proc.stdout[-3000:]
    assert "every thread's stack of each rank is in its log (logs/rank<N>.log" in proc.stdout
    logs = {rank: (tmp_path / "reports" / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)}
    for rank, log in logs.items():
        assert f"# stackproof watchdog: rank {rank}: test_04_collectives.py::test_barrier still running after 8 s" \
            in log, log
        assert "Current thread" in log and "in _fire" in log  # the watchdog's thread ...
        assert re.search(r"^Thread 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)+", log, re.M), log
    assert re.search(r'File ".*faults\.py", line \d+ in stop_if_asked\n  File ".*test_04_collectives\.py", '
                     r"line \d+ in test_barrier", logs[1]), logs[1]  # ... and the main thread, where it is stuck
    assert re.search(r'File ".*dist\.py", line \d+ in _decide', logs[0]), logs[0]


def test_cpu_runs_check_all_reduce_at_16_mib_by_default(tmp_path):
    proc, report = validate(tmp_path, "-k", "all_reduce and sum-float32")
    assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
    assert checks(report, "passed")["collectives::all_reduce[sum-float32]"]["figures"]["largest"]["value"] >= 16 << 20


def test_resnet_memory_per_rank_does_not_grow_with_the_world(tmp_path):
    """The synthetic data is made per sample on demand: a rank holds its batch, whatever the world size."""
    seen = {}
    for nproc in (2, 4):
        proc, report = validate(tmp_path / str(nproc), "--nproc", str(nproc), "--train-batch", "8",
                                "--train-steps", "2", "--bench-steps", "1", "-k", "ddp and loss")
        assert proc.returncode == EXIT_OK, proc.stdout[-3000:]
        check = checks(report, "passed")["ddp_resnet::loss_is_finite_and_decreasing"]
        figures = [check["figures"], *check["rank_figures"].values()]
        seen[nproc] = {"input": {f["input_bytes"]["value"] for f in figures},
                       "rss": max(f["peak_rss"]["value"] for f in figures)}
    assert seen[2]["input"] == seen[4]["input"] == {8 * 3 * 64 * 64 * 4 + 8 * 8}
    print(f"peak RSS per rank (MiB): 2 ranks {seen[2]['rss']}, 4 ranks {seen[4]['rss']}")
    assert seen[4]["rss"] <= seen[2]["rss"] * 1.05, seen


def test_an_injected_fault_no_selected_check_injects_is_bad_input_not_ok(tmp_path):
    """Issue 36 item 13: `--inject-fault crash` with no check that injects it selected ended OK, silently."""
    proc, report = validate(tmp_path, "--nproc", "2", "-k", "dev_shm", "--inject-fault", "crash", "--timeout", "60")
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "--inject-fault crash: expected a selected check that injects it, found none that ran" in report["message"]
    assert "# Verdict: FAILED (exit code 2" in proc.stdout
