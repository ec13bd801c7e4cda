"""Where a validation run's wall time goes, cold, warm and with the warm agent side by side, in one call: start,
imports, CUDA init, process-group init, checks, the ranks' exit.

    python benchmarks/startup.py                              # validate --tier fast: 1 cold, 3 warm, 3 agent runs
    python benchmarks/startup.py --drop-caches -- healthcheck --scheduler none    # what issue 35's targets read
    python benchmarks/startup.py --modes warm -- validate     # the full tier, warm only

Runs `python -m stackproof ARGS --reports TMP` and prints one row per phase, in seconds since the command
started: what the terminal showed (the header line, the verdict line, the exit) and what the run recorded in
report.json's context["phases"] (epoch times: the launcher's start and its ranks' start, each rank's torch import,
CUDA init, process group, then the checks, every rank's record complete (ranks_done: the last rank said it
leaves) and every rank's process gone (ranks_exited: the kernel's and the driver's teardown included); the slowest
rank's time for per-rank phases), plus the sum of the checks' own durations and each check's. `cold`: the call's
first run, each rank importing torch (after emptying the page cache with --drop-caches, as root); `warm`: the
runs after it, the same way; `agent`: the ranks are forked by a warm agent (stackproof warm-agent, started here on
a private socket from this environment; its own start-up is printed, not counted). After the agent's runs the
idle agent is asked whether CUDA is initialised in it, and NVML whether it holds any GPU. Figures, not a test:
the targets (issue 35, healthcheck on one H200: <= 7 s cold, <= 5 s warm, <= 3 s with the agent) are read here,
never asserted in CI.

Measured on 1 x H200 (torch 2.11, cf42ec9, medians of 3): healthcheck --scheduler none 8.08 s without the agent
(torch imported at 5.04 s; 3.5 to 5.4 s from one machine to the next), 3.90 s with it (torch at 0.46 s); the
checks 2.3-2.5 s, the ranks' exit after them 0.3 s (1.3 s at e3b2c64). `--sample DIR` keeps every process's
sampled stacks (benchmarks/sampler); `benchmarks/sampled.py DIR` says where each phase's time went.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stackproof.report import folders  # noqa: E402 (after the checkout is on the path)
from stackproof.run import warm  # noqa: E402
from stackproof.run.phases import RANK_PHASES, RUN_PHASES  # noqa: E402

# The rows, in the order a run passes them: what the terminal showed, and what report.json recorded.
ORDER = ("launcher_started", "header", *RANK_PHASES, "checks_started", "first_table_line", "checks_done",
         "ranks_done", "ranks_exited", "verdict", "exit")
# cold: the call's first run without the agent (after dropping the page cache when --drop-caches may); warm: the
# runs after it, still without the agent (each rank imports torch, from a warm page cache); agent: the ranks
# forked by a warm agent.
MODES = ("cold", "warm", "agent")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
AGENT_START_S = 300.0


def sampled_env(folder: Path | None) -> dict[str, str] | None:
    """The environment whose Python processes sample their stacks into folder (benchmarks/sampler)."""
    if folder is None:
        return None
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks" / "sampler"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "SAMPLE_DIR": str(folder / "samples")}


def one_run(args: list[str], timeout_s: float, extra: list[str], sample: Path | None = None,
            shared_samples: Path | None = None) -> dict[str, float | None]:
    """One run; with `sample`, its processes' stacks and its report.json are kept there (an agent's ranks sample
    into the agent's folder, `shared_samples`, copied here after the run)."""
    with tempfile.TemporaryDirectory(prefix="stackproof-startup-") as reports:
        command = [sys.executable, "-m", "stackproof", *args, *extra, "--reports", reports]
        seen: dict[str, float | None] = {"header": None, "first_table_line": None, "verdict": None}
        begin = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=sampled_env(sample))
        assert proc.stdout is not None
        started_how = ""
        for line in proc.stdout:
            now = time.time() - begin
            if line.startswith("# stackproof validate:") and seen["header"] is None:
                seen["header"] = now
            elif line.startswith("# stackproof validate:") and " start" in line and not started_how:
                started_how = line.strip()
            elif seen["header"] is not None and seen["first_table_line"] is None and line.strip():
                seen["first_table_line"] = now
            if line.startswith("# Verdict:"):
                seen["verdict"] = now
        rc = proc.wait(timeout=timeout_s)
        seen["exit"] = time.time() - begin
        try:  # healthcheck keeps its runs (--keep-runs): the newest
            report = json.loads((folders.current(Path(reports)) / "report.json").read_text())
        except (OSError, ValueError):
            report = {}
        if sample is not None:
            (sample / "report.json").write_text(json.dumps(report))
            if shared_samples is not None:
                shutil.copytree(shared_samples, sample / "samples", dirs_exist_ok=True)
    phases = report.get("context", {}).get("phases", {})
    for name in ("launcher_started", *RUN_PHASES):
        seen[name] = phases[name] - begin if phases.get(name) else None
    for name in RANK_PHASES:  # the slowest rank's
        times = [r[name] for r in phases.get("ranks") or [] if r.get(name)]
        seen[name] = max(times) - begin if times else None
    row: dict = {name: seen.get(name) for name in ORDER}
    row["exit code"] = rc
    row["checks (sum of their own seconds)"] = sum(c.get("duration_s", 0.0) for c in report.get("checks", []))
    for name, first, last in (("ranks' exit after the checks", "checks_done", "ranks_exited"),
                              ("  checks done -> every record complete", "checks_done", "ranks_done"),
                              ("  records complete -> ranks gone (teardown)", "ranks_done", "ranks_exited"),
                              ("ranks gone -> the command's exit", "ranks_exited", "exit")):
        if seen.get(first) is not None and seen.get(last) is not None:
            row[name] = seen[last] - seen[first]
    for check in report.get("checks", []):
        row[f"  {check['name']}"] = check.get("duration_s")
    row["_how"] = started_how
    return row


@contextlib.contextmanager
def agent(socket_path: str, sample: Path | None = None) -> Iterator[subprocess.Popen]:
    """A warm agent from this environment, on a private socket, for the warm runs."""
    begin = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "stackproof", "warm-agent", "--socket", socket_path],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=sampled_env(sample))
    assert proc.stdout is not None
    try:
        ready = proc.stdout.readline().strip()
        if not ready:
            raise SystemExit(f"the warm agent did not start (exit {proc.wait(timeout=AGENT_START_S)})")
        print(f"{ready} (after {time.time() - begin:.2f} s)", flush=True)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def idle_agent(socket_path: str, pid: int) -> str:
    """What the idle agent holds: CUDA (its own answer) and GPUs (NVML's list of each GPU's processes)."""
    state = warm.status(socket_path)
    words = (f"# idle warm agent (pid {pid}): CUDA initialised in it: {'YES' if state['cuda_initialized'] else 'no'}, "
             f"CUDA driver (libcuda) initialised: {'YES' if state['cuda_driver_initialised'] else 'no'} (mapped: "
             f"{'yes' if state['cuda_driver_loaded'] else 'no'})")
    try:
        from stackproof.act.hardware import gpu_use

        use = gpu_use()
    except Exception as err:  # no NVML here (CPU ranks): said, not a failure of the benchmark
        return f"{words}; NVML: {err}"
    held = [u.index for u in use if pid in u.pids]
    return (f"{words}; NVML: {'on GPU(s) ' + str(held) if held else 'in no GPU'}'s compute/graphics processes "
            f"({len(use)} GPU(s); their processes: {[list(u.pids) for u in use]})")


# One rank's way out, apart: a process that did what a fast-tier rank does to its GPU (CUDA's context, the memory
# test's allocations given back, 512 MiB of pinned host memory, a process group with a communicator) and then
# tears the process group down or not, and leaves with os._exit, as a rank does. It prints when it starts
# leaving; the parent times the rest (the kernel's and the driver's teardown) until the process is gone.
EXIT_PROBE = """
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
from stackproof.measure import memtest
destroy = sys.argv[1] == "destroy"
gpu = torch.cuda.is_available()
device = torch.device("cuda", 0) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(device)
    memtest.run(device, 1)
pinned = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=gpu)
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=0, world_size=1,
                        device_id=device if gpu else None)
dist.all_reduce(torch.ones(1, device=device))
if gpu:
    torch.cuda.synchronize()
began = time.time()
if destroy:
    dist.destroy_process_group()
print(json.dumps({"destroy_s": time.time() - began if destroy else None, "leaving": time.time(),
                  "backend": "nccl" if gpu else "gloo"}), flush=True)
os._exit(0)
"""


def exit_costs(timeout_s: float) -> list[str]:
    """What a rank's way out costs on this machine: NCCL's destroy, and the process's own exit after it or
    without it (the fast exit's way)."""
    lines = []
    for how in ("destroy", "exit"):
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        proc = subprocess.Popen([sys.executable, "-c", EXIT_PROBE, how], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": path})
        said = proc.stdout.readline() if proc.stdout else ""
        proc.wait(timeout=timeout_s)
        gone = time.time()
        try:
            probe = json.loads(said)
        except ValueError:
            lines.append(f"# exit probe ({how}): failed (exit {proc.returncode}): {said.strip()[:200]}")
            continue
        destroyed = "" if probe["destroy_s"] is None else f"destroy_process_group {probe['destroy_s']:.2f} s, then "
        lines.append(f"# a rank's way out ({probe['backend']}, {'with' if how == 'destroy' else 'without'} the "
                     f"process group's teardown): {destroyed}os._exit until the process is gone "
                     f"{gone - probe['leaving']:.2f} s")
    return lines


def nvml_session_costs(times: int = 5) -> str:
    """What one NVML session (nvmlInit, nvmlShutdown) of a check costs alone, and with NVML held open beside it
    (run/readings.py holds it for the rank's life)."""
    from stackproof.measure import topology

    def sessions() -> float:
        began = time.perf_counter()
        for _ in range(times):
            with topology.nvml_session():
                pass
        return (time.perf_counter() - began) / times

    try:
        alone = sessions()
        with topology.nvml_session():
            held = sessions()
    except topology.NvmlUnavailable as err:
        return f"# an NVML session: {err}"
    return (f"# an NVML session (init + shutdown), mean of {times}: {alone * 1e3:.1f} ms alone, {held * 1e3:.1f} ms "
            "with NVML held")


def drop_caches() -> str:
    """Empty the kernel's page cache (root only), so the cold run reads torch's libraries from disk."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as err:
        return f"the first run of this call; the page cache was NOT dropped ({err.strerror or err})"
    return f"the first run of this call, after emptying the page cache ({DROP_CACHES})"


def table(columns: dict[str, dict[str, float | None]]) -> str:
    names: list[str] = []
    for run in columns.values():
        names += [n for n in run if n not in names and not n.startswith("_")]
    width = max(8, *(len(c) for c in columns))
    lines = [f"# {'phase':<48} " + " ".join(f"{c:>{width}}" for c in columns),
             f"# {'(s since the command started; checks: own seconds)':<48}"]
    for name in names:
        cells = " ".join(f"{v:>{width}.2f}" if (v := run.get(name)) is not None else f"{'-':>{width}}"
                         for run in columns.values())
        lines.append(f"  {name:<48} {cells}")
    return "\n".join(lines)


def medians(runs: list[dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in dict.fromkeys(n for run in runs for n in run if not n.startswith("_")):
        known = [v for run in runs if (v := run.get(name)) is not None]
        out[name] = statistics.median(known) if known else None
    return out


def bytecode() -> str:
    """Whether the modules every process imports have compiled bytecode where this interpreter looks for it: without
    it each process compiles them at its start (the H200 host's torch had none, and PYTHONDONTWRITEBYTECODE=1: a
    rank's import took 2.7 s, 1.65 s once compiled)."""
    said = []
    for name in ("torch", "stackproof"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            said.append(f"{name}: not found")
            continue
        sources = list(Path(spec.origin).parent.rglob("*.py"))
        cached = sum(Path(importlib.util.cache_from_source(str(path))).exists() for path in sources)
        said.append(f"{name} {cached} of {len(sources)} modules")
    settings = [f"{key}={os.environ[key]}" for key in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
                if os.environ.get(key)]
    return f"# compiled bytecode: {', '.join(said)}{'; ' + ', '.join(settings) if settings else ''}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of the warm and agent modes (cold: one)")
    parser.add_argument("--drop-caches", action="store_true",
                        help=f"before the cold run, write 3 to {DROP_CACHES} (root only; said when refused)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=None, help="also write what is printed to this file")
    parser.add_argument("--exit-costs", action="store_true",
                        help="also time a rank's way out apart (NCCL's destroy, the process's exit with and without "
                             "it) and an NVML session alone and with NVML held")
    parser.add_argument("--sample", type=Path, default=None, metavar="DIR",
                        help="keep each run's report.json and its processes' sampled stacks under DIR/<run> "
                             "(benchmarks/sampler; read them with benchmarks/sampled.py DIR)")
    parser.add_argument("args", nargs="*", help="stackproof's command and flags (default: validate --tier fast)")
    options = parser.parse_args(argv)
    args = options.args or ["validate", "--tier", "fast"]
    modes = [m for m in options.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: expected some of {', '.join(MODES)}, found {options.modes!r}")
    print(f"# python -m stackproof {' '.join(args)}: {options.runs} run(s) each of {', '.join(modes)}", flush=True)
    columns: dict[str, dict] = {}
    notes: list[str] = [bytecode()]
    def kept(name: str) -> Path | None:
        return None if options.sample is None else options.sample / name

    for mode in modes:
        if mode == "cold":
            notes.append(f"# cold: {drop_caches() if options.drop_caches else 'the first run of this call'}")
            runs = [one_run(args, options.timeout, ["--cold"], kept("cold"))]
        elif mode == "warm":
            runs = [one_run(args, options.timeout, ["--cold"], kept(f"warm {i}")) for i in range(1, options.runs + 1)]
        else:
            with tempfile.TemporaryDirectory(prefix="stackproof-warm-") as folder:
                path = os.path.join(folder, "warm.sock")
                with agent(path, kept("agent")) as proc:
                    runs = [one_run(args, options.timeout, ["--warm-socket", path], kept(f"agent {i}"),
                                    kept("agent") and kept("agent") / "samples")
                            for i in range(1, options.runs + 1)]
                    notes.append(idle_agent(path, proc.pid))
        for i, run in enumerate(runs, 1):
            name = mode if len(runs) == 1 else f"{mode} {i}"
            columns[name] = run
            notes.append(f"# {name}: {run['_how'].removeprefix('# stackproof validate: ')}")
        if len(runs) > 1:
            columns[f"{mode} med"] = medians(runs)
    summary = ", ".join(f"{mode} {columns[name]['exit']:.2f} s" for mode in modes
                        for name in (f"{mode} med", mode) if name in columns and columns[name].get("exit") is not None)
    notes.append(f"# the command's exit: {summary}")
    if options.exit_costs:
        notes += [*exit_costs(options.timeout), nvml_session_costs()]
    text = f"{table(columns)}\n" + "\n".join(notes)
    print(text, flush=True)
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(f"# python -m stackproof {' '.join(args)}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
