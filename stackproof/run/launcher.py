"""`stackproof validate`: check the input, decide how many ranks, start them, and settle what they did into one
record and exit code (settle.py). Under torchrun or srun it is itself one rank and runs the suite directly.

The launcher never imports torch: on one node it starts the ranks itself (stackproof/run/local_ranks.py) the moment
the input is checked, so their torch imports are the run's only ones; across nodes each node's ranks come from
torchrun's agent (agent.py), which needs a rendezvous between nodes."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from stackproof import environment
from stackproof.errors import ConfigError, Exit
from stackproof.judge import hardware
from stackproof.judge.findings import Finding
from stackproof.measure import pins, topology
from stackproof.report.record import Report
from stackproof.run import local_ranks, phases, settle, warm
from stackproof.run.config import NODE_NAME_ENV, ValidateConfig
from stackproof.run.deadline import Deadline
from stackproof.run.launch_env import (
    LAUNCHED_ENV,
    RUN_ENDS_ENV,
    adopt_slurm_env,
    check_launcher_env,
    launched_by_a_launcher,
)
from stackproof.run.visibility import hardware_verdict

KILL_GRACE_S = local_ranks.KILL_GRACE_S

def check_input(settings: ValidateConfig, env: Mapping[str, str]) -> None:
    """Bad input ends the run here, with exit 2, before any rank starts. `env`: the environment it was started
    with (environment.current(), or healthcheck's, less a job's rank variables)."""
    if environment.PYTEST_ADDOPTS.get(env):
        raise ConfigError(f"PYTEST_ADDOPTS={environment.PYTEST_ADDOPTS.get(env)!r} is set: the suite runs its own "
                          "pytest; fix: unset it, and pass pytest options after -- (stackproof validate -- -x)")
    check_launcher_env(env)
    _check_selection(settings.select)
    # A missing/invalid file or image: exit 2.
    pins.expected(settings.expect_file, settings.image, env, settings.expect_declared)


def _check_selection(select: str | None) -> None:
    """A -k expression pytest cannot parse: said here, not by every rank's pytest."""
    if not select:
        return
    from _pytest.mark.expression import Expression  # pytest's own -k parser (ParseError in 8, SyntaxError in 9)

    try:
        Expression.compile(select)
    except Exception as err:
        raise ConfigError(f"-k {select!r}: expected a pytest -k expression (names joined with and / or / not, "
                          f"parentheses), found: {err}; fix: e.g. -k 'collectives and not bfloat16'") from None


def validate(settings: ValidateConfig) -> int:
    """`stackproof validate`: this process is a rank (started by torchrun or srun), or the launcher."""
    env = environment.current()  # read once: what the launcher (torchrun, srun, ours) told this process
    check_input(settings, env)
    if launched_by_a_launcher(env):
        world = dict(env)
        adopt_slurm_env(world)
        environment.export(world)  # torch.distributed's env:// reads RANK, WORLD_SIZE, MASTER_ADDR ... there
        threading.Thread(target=_early_cuda_context, args=(int(environment.LOCAL_RANK.get(world)),),
                         name="stackproof-early-cuda", daemon=True).start()  # meanwhile:
        from stackproof.run import worker  # imports torch

        return worker.run(settings, world)
    return int(launch(settings, env=env).exit_code)


def launch(settings: ValidateConfig, clock: Deadline | None = None, env: Mapping[str, str] | None = None) -> Report:
    """Start this node's ranks and return the run's settled record (printed, and written to the reports folder).
    `clock`: when the ranks must be stopped by (healthcheck's --deadline less stopping them and acting): the NVML
    survey and the ranks each take at most what it leaves (the ranks' --run-timeout included). `env`: the
    environment to start them in (default: this process's)."""
    env = environment.current() if env is None else env
    check_input(settings, env)
    started = phases.process_started()
    survey_s = topology.SURVEY_DEADLINE_S if clock is None else clock.call_timeout(topology.SURVEY_DEADLINE_S)
    inventory = topology.survey(settings.pci_devices, survey_s)  # NVML only: no CUDA context, no torch
    chosen = settings.visible_devices or environment.CUDA_VISIBLE_DEVICES.get(env)
    visible = (len(topology.visible(inventory, chosen)) if inventory is not None else gpus_without_nvml())
    nproc = visible or settings.nproc  # one rank per visible GPU
    settings.check_world(nproc * settings.nnodes)
    held = settle.prepare(settings.reports_dir, settings.nnodes, settings.keep_runs)  # this run's until settled
    if held.folder != settings.reports_dir:  # --keep-runs: the run writes in its own folder (report/folders.py)
        settings = dataclasses.replace(settings, reports=str(held.folder), keep_runs=0,  # the last looks stay under
                                       state_dir=str(settings.health_state_dir))  # the root, across the runs
    try:
        stopped = hardware_verdict(settings, inventory, visible, sys.stdout)  # exit 3's record: in the run's folder
        if stopped is not None:
            return stopped
        print(f"# stackproof validate: {nproc} rank(s) on this node "
              f"({'NCCL, one per GPU' if visible else 'gloo, CPU'}) of {settings.nnodes} node(s), tier "
              f"{settings.tier}; reports: {settings.reports}", flush=True)
        if clock is not None:  # the survey's time, or the part of it NVML did not take, is the ranks'
            ranks_s = max(1.0, clock.call_timeout(settings.run_timeout))
            settings = dataclasses.replace(settings, run_timeout=ranks_s, timeout=min(settings.timeout, ranks_s))
        env = {**env, LAUNCHED_ENV: f"{started:.3f}",
               # the name resolved once (--node-name / healthcheck's --node): every node_name() of the ranks says it
               **({NODE_NAME_ENV: settings.node_name} if settings.node_name else {}),
               **({"CUDA_VISIBLE_DEVICES": settings.visible_devices} if settings.visible_devices else {})}
        if settings.nnodes == 1 and not settings.rdzv_endpoint:
            start, how = ((None, "cold start (--cold)") if settings.cold else
                          warm.starter(settings.warm_socket, [settings.reports_dir]))
            print(f"# stackproof validate: {how}{uncompiled_torch() if start is None else ''}", flush=True)
            outcome = local_ranks.run([sys.executable, "-m", "stackproof", "validate", *settings.to_argv()], nproc,
                                      env, settings.run_timeout, start=start)
            refused = outcome.failures and all(f["exitcode"] == Exit.USAGE for f in outcome.failures)
            return settle.conclude(settings.reports_dir, sys.stdout, launcher_exit=outcome.exit_code,
                                   failures=None if refused else outcome.failures,
                                   refused=[f["rank"] for f in outcome.failures] if refused else None,
                                   interrupted=outcome.interrupted,
                                   timed_out_s=settings.run_timeout if outcome.timed_out else None,
                                   phases={**outcome.left, "ranks_exited": time.time()},
                                   findings=[*_unkillable(settings, outcome.unkillable, inventory),
                                             *_after_signals(settings, outcome.failures, inventory, started,
                                                             clock)])
        rc, interrupted, timed_out, stuck = _torchrun(settings, nproc, env)
        return settle.conclude(settings.reports_dir, sys.stdout, launcher_exit=rc, interrupted=interrupted,
                               timed_out_s=settings.run_timeout if timed_out else None,
                               findings=_unkillable(settings, stuck, inventory))
    finally:
        held.release()


def _unkillable(settings: ValidateConfig, stuck: list[dict], inventory: topology.Inventory | None) -> list[Finding]:
    """Ranks the kernel could not kill (local_ranks.Outcome.unkillable): a finding on the GPU each drove (rank r
    drives the r-th visible GPU), for the record's run-level findings; the run goes on to its verdict."""
    gpus = topology.visible(inventory, settings.visible_devices or topology.cuda_visible_devices()) if inventory else []
    found = []
    for rank in stuck:
        gpu = gpus[rank["rank"]] if rank["rank"] < len(gpus) else None
        finding = hardware.unkillable(rank["rank"], rank["pid"], rank["state"], rank["wchan"],
                                      gpu.index if gpu else None, gpu.uuid if gpu else "n/a")
        found.append(finding.at(node=settings.node, rank=rank["rank"],
                                pci_bus_id=(gpu.pci_bus_id or "") if gpu else "",
                                source="launcher: stopping the ranks"))
    return found


def _after_signals(settings: ValidateConfig, failures: list[dict], inventory: topology.Inventory | None,
                   started: float, clock: Deadline | None) -> list[Finding]:
    """The GPUs of ranks that died on a fatal signal (hardware.FATAL_SIGNALS), looked at again: a fresh NVML
    survey (bounded as the first) and the XIDs the kernel logged for each since this run started. Run-level
    findings, so the verdict and act see them; none on CPU ranks or when the GPU reads healthy."""
    fatal = [f for f in failures if f["exitcode"] < 0 and _signal_name(-f["exitcode"]) in hardware.FATAL_SIGNALS]
    gpus = topology.visible(inventory, settings.visible_devices or topology.cuda_visible_devices()) \
        if fatal and inventory is not None else []
    fatal = [f for f in fatal if f["rank"] < len(gpus)]
    if not fatal:
        return []
    from stackproof.judge import health as rules
    from stackproof.measure import health

    survey_s = topology.SURVEY_DEADLINE_S if clock is None else clock.call_timeout(topology.SURVEY_DEADLINE_S)
    now = topology.survey(settings.pci_devices, survey_s)
    log = health.read_kernel_log(settings.kernel_log, since=started)
    found = []
    for failure in fatal:
        gpu, died_on = gpus[failure["rank"]], _signal_name(-failure["exitcode"])
        xids = rules.xid_findings(gpu.index, gpu.uuid, rules.kernel_xids(log.records, gpu.pci_bus_id, started))
        for finding in hardware.after_a_signal(failure["rank"], died_on, gpu, None if now is None else now.gpus, xids,
                                               None if now is None else now.unreachable,
                                               "" if now is None else now.stalled):
            found.append(finding.at(node=settings.node, rank=failure["rank"],
                                    pci_bus_id=gpu.pci_bus_id or "", source=f"launcher: rank {failure['rank']} "
                                                                            f"died on {died_on}"))
    return found


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def uncompiled_torch() -> str:
    """What a cold start adds when torch's modules have no compiled bytecode where this interpreter looks (an
    install without .pyc files, PYTHONDONTWRITEBYTECODE=1): each rank compiles them at its start, 1.1 s of a 2.7 s
    import on an H200 host. Asked of torch/__init__.py's bytecode, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return ""
    return (f"; torch's modules have no compiled bytecode here, so each rank compiles them at its start (about 1 s); "
            f"fix: python -m compileall -q {Path(spec.origin).parents[1]} as the install's owner, or install with "
            "pip (uv: --compile-bytecode)")


def _early_cuda_context(local_rank: int) -> None:
    """A rank's CUDA context, created while the rank imports torch: `import torch` takes seconds and needs no GPU,
    creating the context takes most of a second and needs no torch. The context made here through the driver API
    is the device's primary context, the one the CUDA runtime (torch) uses, so torch.cuda.set_device later finds
    it ready. Best effort: whatever fails here, torch's own initialisation meets again, and reports."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return  # no driver here: torch sees no GPU, and the run says so
    device, context = ctypes.c_int(), ctypes.c_void_p()
    # ctypes releases the GIL during each call: the import goes on meanwhile. Any error code: leave it to torch.
    if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), local_rank) == 0:
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)


def gpus_without_nvml() -> int:
    """GPUs this node's ranks can use where NVML cannot answer, without a CUDA context where possible: no CUDA
    driver means none, and only a driver whose NVML is not mounted (NVIDIA_DRIVER_CAPABILITIES without utility)
    asks torch."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0  # no CUDA driver: torch.cuda.device_count() would say 0 too
    import torch

    return torch.cuda.device_count()


def _torchrun(settings: ValidateConfig, nproc: int,
              env: dict[str, str]) -> tuple[int, str | None, bool, list[dict]]:
    """(torchrun's exit code, the signal that interrupted the run if any, whether --run-timeout stopped it, what
    _kill could not stop: the settled record's finding, as local_ranks' unkillable ranks are)."""
    cmd = [sys.executable, "-m", "stackproof.run.agent", settings.reports, *settings.torchrun_rendezvous(),
           f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=1",
           "-m", "--", "stackproof", "validate", *settings.to_argv()]
    # Share the cores between ranks (torchrun would pin each to one thread, with a warning).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[RUN_ENDS_ENV] = f"{time.time() + settings.run_timeout:.3f}"  # the ranks' watchdog fires before the stop
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    interrupted: list[str] = []

    stuck: list[dict] = []

    def stop(signum: int, _frame: object) -> None:
        # Ctrl-C / docker stop: stop every rank, not only torchrun, and say so in the verdict.
        interrupted.append(signal.Signals(signum).name)
        stuck.extend(filter(None, [_kill(proc, signum)]))

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait(timeout=settings.run_timeout)
        return rc, (interrupted[0] if interrupted else None), False, stuck
    except subprocess.TimeoutExpired:
        stuck.extend(filter(None, [_kill(proc, signal.SIGTERM)]))
        return -1, None, True, stuck
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill(proc: subprocess.Popen, signum: int) -> dict | None:
    """Stop torchrun's agent and its ranks (its process group): SIGKILL after the grace, then a bounded wait.
    The agent still there after that (the kernel cannot kill it), as local_ranks.stuck_rank words it, else None."""
    try:
        os.killpg(proc.pid, signum)
        proc.wait(timeout=local_ranks.KILL_GRACE_S)
        return None
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return None if local_ranks.reap(proc, local_ranks.KILL_WAIT_S) else local_ranks.stuck_rank(0, proc.pid)
