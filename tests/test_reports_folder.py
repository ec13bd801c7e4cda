"""No report lost, none shown as a pass (issue 20, items 1-4, 6, 14): one run at a time per reports folder, an
empty reports setting, `-o` onto a run's report, `verdict` on a folder no rank wrote, a full disk (a real 64 KiB
tmpfs, mounted in a user namespace), an unreadable report.json, and rank 0's real error when its store goes away."""

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
from test_validate_cpu import EXIT_OK, stackproof

from stackproof.errors import Exit

PYTHON = sys.executable
HOST = ["-k", "host"]  # the shortest real run: two gloo ranks, one check


def run(*args, cwd=None, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STACKPROOF_") and k != "PYTEST_ADDOPTS"}
    env.update(env_extra or {})
    return subprocess.run([PYTHON, "-m", "stackproof", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_a_second_run_on_a_busy_reports_folder_is_refused_naming_the_first(tmp_path):
    """Item 1: the second run printed the first run's table as its own verdict (or lost its report)."""
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STACKPROOF_")}
    first = subprocess.Popen([PYTHON, "-m", "stackproof", "validate", "--reports", str(reports), *HOST],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lock = reports / ".stackproof.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = run("validate", "--reports", reports, *HOST)
    out, err = first.communicate(timeout=300)
    assert first.returncode == EXIT_OK, out[-2000:] + err[-2000:]
    assert second.returncode == Exit.USAGE, second.stdout + second.stderr
    assert f"stackproof run pid {first.pid} on " in second.stderr and "started 20" in second.stderr
    assert "fix: wait for it to finish, or give this run a folder of its own" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and "Verdict" not in second.stdout
    report = json.loads((reports / "report.json").read_text())
    assert report["verdict"] == "OK" and report["complete"]  # the first run's report, untouched


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(tmp_path):
    """Item 1: flock dies with its process, so a crash leaves nothing that blocks."""
    reports = tmp_path / "reports"
    holder = subprocess.Popen([PYTHON, "-c", "import sys, time; from pathlib import Path; "
                               "from stackproof.run import settle; settle.prepare(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(300)", str(reports)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    refused = run("validate", "--reports", reports, *HOST)
    assert refused.returncode == Exit.USAGE and f"pid {holder.pid}" in refused.stderr
    holder.kill()
    holder.wait()
    assert f"pid {holder.pid}" in (reports / ".stackproof.lock").read_text()  # the dead run's words are still there
    from stackproof.run import settle

    held = settle.prepare(reports)  # what the next run's launcher does first: the folder is free
    assert f"pid {os.getpid()} on " in (reports / ".stackproof.lock").read_text()
    held.release()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_reports_setting_is_bad_input_and_writes_nothing(tmp_path, how):
    """Item 2: `--reports ""` and `STACKPROOF_REPORTS=` wrote report.json and junit.xml into the current folder."""
    args, env = (["--reports", ""], None) if how == "flag" else ([], {"STACKPROOF_REPORTS": ""})
    proc = run("validate", *args, *HOST, cwd=tmp_path, env_extra=env)
    assert proc.returncode == Exit.USAGE, proc.stdout + proc.stderr
    assert ("--reports: expected a non-empty value, found ''" if how == "flag" else
            "STACKPROOF_REPORTS='': expected a non-empty value, found ''; fix:") in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A real run's reports folder."""
    reports = tmp_path_factory.mktemp("finished") / "reports"
    proc = run("validate", "--reports", reports, *HOST)
    assert proc.returncode == EXIT_OK, proc.stdout[-2000:] + proc.stderr[-2000:]
    return reports


@pytest.mark.parametrize("command", ["report", "baseline"])
def test_output_onto_a_runs_report_or_a_folder_is_refused(finished, tmp_path, command):
    """Item 3: `-o R/report.json` destroyed the run's report; `-o` naming a folder raised IsADirectoryError."""
    before = (finished / "report.json").read_bytes()
    copy = tmp_path / "other-run.json"
    copy.write_bytes(before)
    for output, words in [(finished / "report.json", "one of the reports it reads"),
                          (copy, "a run's report.json (overwriting it would lose the run)"), (tmp_path, "a folder")]:
        proc = stackproof(command, finished, "-o", output)
        assert proc.returncode == Exit.USAGE, (output, proc.stdout, proc.stderr)
        assert f"-o {output}: expected a file to write the" in proc.stderr and words in proc.stderr
        assert "Traceback" not in proc.stderr
    assert (finished / "report.json").read_bytes() == before and copy.read_bytes() == before


def test_verdict_on_a_missing_or_unwritten_folder_is_not_a_pass(tmp_path):
    """Item 4: `verdict --reports /no/such/dir` exited 0, and validate.sbatch ends with it."""
    missing = run("verdict", "--reports", tmp_path / "no" / "such")
    assert missing.returncode == Exit.USAGE and "expected the run's reports folder, found no such folder" in \
        missing.stderr
    (tmp_path / "empty").mkdir()
    empty = run("verdict", "--reports", tmp_path / "empty")
    assert empty.returncode == Exit.INCOMPLETE and "no rank of this run wrote here" in empty.stdout
    (tmp_path / "other" / "logs").mkdir(parents=True)
    (tmp_path / "other" / "logs" / "rank1.log").write_text("1 passed")
    other = run("verdict", "--reports", tmp_path / "other")  # a node whose ranks ran, rank 0's report elsewhere
    assert other.returncode == EXIT_OK and "rank 0's node holds the verdict" in other.stdout


def _in_a_full_tmpfs(tmp_path, script):
    """`script` (sh) with $R a fresh 64 KiB tmpfs, mounted in a user and mount namespace of its own."""
    mount = tmp_path / "full"
    mount.mkdir()
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           'mount -t tmpfs -o size=64k tmpfs "$R" || exit 97\n' + script],
                          capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("STACKPROOF_")},
                               "R": str(mount), "PY": PYTHON})
    if proc.returncode == 97 or "unshare" in proc.stderr[:200]:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()[:200]}")
    return proc


def test_a_reports_folder_without_room_is_refused_in_one_line(tmp_path):
    """Item 6: on a 64 KiB tmpfs, validate printed tracebacks, exit 1, no verdict line, and left .tmp files."""
    proc = _in_a_full_tmpfs(tmp_path, '"$PY" -m stackproof validate --reports "$R" -k host; rc=$?\n'
                                      'echo "files: $(ls -A "$R" | tr "\\n" " ")"; exit $rc')
    assert proc.returncode == Exit.USAGE, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "found it 64 KiB free, less than the 16 MiB the report and the rank logs need" in proc.stderr
    assert proc.stdout.strip() == "files:"  # nothing written, nothing left


def test_a_disk_that_fills_during_the_run_is_a_tool_error_in_one_line_leaving_no_temporary_file(tmp_path):
    """Item 6: the disk fills after the start-up check. The launcher's settling write fails: one line, exit 4
    (the run did not complete: its verdict could not be recorded; no check failed), no .tmp file left."""
    proc = _in_a_full_tmpfs(tmp_path, 'mkdir -p "$R/logs" && echo "1 passed" > "$R/logs/rank0.log"\n'
                                      'dd if=/dev/zero of="$R/filler" bs=1k count=128 2>/dev/null\n'
                                      '"$PY" -m stackproof verdict --reports "$R" --launcher-exit 1; rc=$?\n'
                                      'echo "files: $(ls -A "$R" | tr "\\n" " ")"; exit $rc')
    assert proc.returncode == Exit.INCOMPLETE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "could not write the run's report (No space left on device)" in proc.stderr
    assert "fix: free space in the reports folder" in proc.stderr
    assert ".tmp" not in proc.stdout and "files: filler logs" in proc.stdout


def test_an_unreadable_report_is_kept_and_its_error_said(tmp_path):
    """Item 14: Report.load returned None on any error, and settle wrote a blank report over the evidence."""
    reports = tmp_path / "reports"
    (reports / "logs").mkdir(parents=True)
    (reports / "report.json").write_text('{"schema": "stackproof.report/2", "checks": [{"nodeid": ')  # cut short
    proc = run("verdict", "--reports", reports, "--launcher-exit", "1")
    assert proc.returncode == Exit.INCOMPLETE, proc.stdout + proc.stderr
    kept = reports / "report.unreadable.json"
    assert kept.read_text().endswith('"nodeid": ')  # the evidence, as it was
    report = json.loads((reports / "report.json").read_text())
    assert "expected a stackproof report.json, found JSONDecodeError" in report["message"]
    assert f"kept as {kept}" in report["message"] and report["exit_code"] == Exit.INCOMPLETE


def test_a_rank_whose_store_went_away_says_so_not_that_rank_0_timed_out():
    """Item 14: every exception in the agreement read "rank 0 did not answer ... within N s"."""
    script = r"""
import datetime, sys, torch.distributed as tdist
from stackproof.run.dist import DistEnv
from stackproof.errors import RankTimeout
port = int(sys.stdin.readline())
client = tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
print("joined", flush=True)
try:
    DistEnv(1, 2, client, timeout_s=30.0).agree(1, "the test", lambda values: values)
except RankTimeout as err:
    print(err, flush=True)
"""
    server = subprocess.Popen([PYTHON, "-c", "import torch.distributed as t, time; s = t.TCPStore('127.0.0.1', 0, "
                               "is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    rank1 = subprocess.Popen([PYTHON, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rank1.stdin.write(server.stdout.readline())
    rank1.stdin.flush()
    assert rank1.stdout.readline().strip() == "joined"
    time.sleep(1)
    server.kill()  # rank 0's store dies while rank 1 waits for its answer
    started = datetime.datetime.now()
    said, _ = rank1.communicate(timeout=120)
    assert "rank 0 did not answer the test: its store went away (rank 0 died?)" in said, said
    assert "DistNetworkError" in said or "Error" in said
    assert (datetime.datetime.now() - started).total_seconds() < 30  # said at once, not after the timeout


def test_a_rank_that_hands_in_after_rank_0_left_says_so_not_a_traceback():
    """Issue 36 item 11: rank 1 entered the verdict agreement after rank 0 had left; its first store call (the
    set) printed DistNetworkError: Broken pipe."""
    script = r"""
import datetime, sys, time, torch.distributed as tdist
from stackproof.run.dist import DistEnv
from stackproof.errors import RankTimeout
port = int(sys.stdin.readline())
client = tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
print("joined", flush=True)
sys.stdin.readline()  # rank 0's store is gone now
try:  # the first write after the peer left is taken by the kernel; the peer answers it with a reset
    client.set("before", "1")
except Exception:
    pass
time.sleep(0.5)
try:
    DistEnv(1, 2, client, timeout_s=30.0).agree(1, "the verdict", lambda values: values)
except RankTimeout as err:
    print(err, flush=True)
"""
    server = subprocess.Popen([PYTHON, "-c", "import torch.distributed as t, time; s = t.TCPStore('127.0.0.1', 0, "
                               "is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    rank1 = subprocess.Popen([PYTHON, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    rank1.stdin.write(server.stdout.readline())
    rank1.stdin.flush()
    assert rank1.stdout.readline().strip() == "joined"
    server.kill()
    server.wait()
    said, err = rank1.communicate("go\n", timeout=120)
    assert "rank 0 did not answer the verdict: its store went away (rank 0 died?)" in said, said + err
    assert "Traceback" not in err, err


def test_the_nodes_of_one_multi_node_run_share_a_folder_that_a_single_node_run_cannot_take(tmp_path):
    from stackproof.errors import ConfigError
    from stackproof.run import settle

    node_a, node_b = settle.claim(tmp_path, nnodes=2), settle.claim(tmp_path, nnodes=2)
    with pytest.raises(ConfigError, match=r"found .*\(node of a 2-node run\).* writing there"):
        settle.claim(tmp_path, nnodes=1)
    node_a.release()
    node_b.release()
    settle.claim(tmp_path, nnodes=1).release()
