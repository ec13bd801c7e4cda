"""What a launcher (torchrun, srun, Kubernetes, stackproof's own) told this process through its environment: whether
it is one rank of a world, and the variables that make that world. Torch-free, so the launcher reads it before
any rank starts, and a variable left over from another job is bad input (exit 2) at once, not a rank that waits
out its rendezvous."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from stackproof import environment
from stackproof.errors import ConfigError
from stackproof.measure.stall import NVML_DEADLINE_S

# Set by whoever started the ranks and settles the verdict afterwards (the launcher, scripts/torchrun,
# scripts/slurm): a rank then exits 0 whenever its checks ran, so rank 0 is not stopped before it writes the
# verdict, and rank 0 leaves the printing of the final table to that launcher. Its value, when a number, is when
# stackproof's launcher started (epoch seconds), for report.json's phases.
LAUNCHED_ENV = environment.LAUNCHED.name
# Set by stackproof's launcher: when it stops the ranks (epoch seconds: --run-timeout from their start). The
# per-check watchdog fires VERDICT_S before it whatever its own limit, so a hang is named by rank 0's verdict, not
# lost to the launcher's stop (a run stopped by --run-timeout names nobody and acts on nothing).
RUN_ENDS_ENV = environment.RUN_ENDS.name
# A rank the watchdog finds outside any collective is looked at again for up to this long before it counts as
# stalled: a rank between two collectives (its own timed out a moment ago, and pytest is reporting it) is waiting
# again within it; a hung one never is. One look alone blamed such a rank too, on a loaded 2-core host.
STALL_LOOK_S = 1.5
# What rank 0 needs once its watchdog fired at the run's end: every rank's answer (all fire at that same moment; a
# stalled rank's comes after its looks, STALL_LOOK_S, and a stalled GPU rank's includes NVML's reading of its GPU,
# at most stall.NVML_DEADLINE_S; watchdog.py waits at most what is left), then the stacks into the logs and the
# verdict written.
VERDICT_S = NVML_DEADLINE_S + STALL_LOOK_S + 1.5
# torch.distributed's env:// rendezvous reads these; torchrun and srun (through adopt_slurm_env) set them all.
WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WHOLE_NUMBERS = ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# srun sets these in every task it starts (Slurm's setup_env); a batch script itself has SLURM_PROCID and
# SLURM_NTASKS but no step id.
SRUN_STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
SLURM_WHOLE_NUMBERS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID")
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# One host or bracketed range per comma: gpu[003-004,010],login1.
_HOST = r"[^\s,\[\]]+(?:\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\][^\s,\[\]]*)*|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\][^\s,\[\]]*"
HOSTLIST = re.compile(rf"(?:{_HOST})(?:,(?:{_HOST}))*")
UNDER_A_LAUNCHER = ("run it as a rank of torchrun, srun or a Kubernetes PyTorchJob (they set RANK, WORLD_SIZE, "
                    "MASTER_ADDR and MASTER_PORT together)")


def adopt_slurm_env(env: dict[str, str]) -> None:
    """Under `srun` (one task per GPU) map Slurm's variables onto torch's, unless torchrun already set them."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["GROUP_RANK"] = env.get("SLURM_NODEID", "0")
    # SLURM_TASKS_PER_NODE reads like "2(x3)": 2 tasks on each of 3 nodes.
    env["LOCAL_WORLD_SIZE"] = (env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")).split("(")[0]
    # Rank 0 (task 0 of the step) runs on the step's first node, and hosts the store there. Not
    # SLURM_LAUNCH_NODE_IPADDR: that is where srun ran (a login node under salloc), where no rank may run.
    # First node of "gpu[003-004,010],login1" -> "gpu003", as `scontrol show hostnames` would list it; parsed
    # here because containers (pyxis) have no scontrol. Its name must resolve on every node, as node names do.
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
        first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)
    else:
        first = env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    env.setdefault("MASTER_ADDR", first)
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def launched_by_a_launcher(env: Mapping[str, str]) -> bool:
    return "RANK" in env or ("SLURM_PROCID" in env and _int(env.get("SLURM_NTASKS", "1"), 1) > 1)


def launcher_started(env: Mapping[str, str]) -> float | None:
    try:
        return float(env.get(LAUNCHED_ENV, ""))
    except ValueError:
        return None  # "1": a script that settles the verdict, not stackproof's launcher


def run_ends(env: Mapping[str, str]) -> float | None:
    """When the launcher stops the ranks (RUN_ENDS_ENV, epoch seconds), or None: no launcher of ours said."""
    try:
        return float(env.get(RUN_ENDS_ENV, ""))
    except ValueError:
        return None


def launched(env: Mapping[str, str]) -> bool:
    """Whether a launcher settles the verdict afterwards: STACKPROOF_LAUNCHED set to a switch (1, a script's) or
    to the launcher's start time (stackproof's). Raises ValueError for anything else."""
    from stackproof.settings import parse_switch

    value = env.get(LAUNCHED_ENV, "")
    return launcher_started(env) is not None or parse_switch(value)


@dataclasses.dataclass(frozen=True)
class Told:
    """What the launcher that started this rank told it (environment.LAUNCHED, environment.RUN_ENDS): read once,
    where the rank reads its settings, and handed down."""
    settles: bool = False  # a launcher settles the verdict afterwards: the rank exits 0 whenever its checks ran
    started: float | None = None  # when stackproof's launcher started (report.json's phases)
    run_ends: float | None = None  # when the launcher stops the ranks (the watchdog fires before)


def told(env: Mapping[str, str]) -> Told:
    """The launcher's word to this rank; a ValueError when STACKPROOF_LAUNCHED is neither a switch nor a time."""
    return Told(launched(env), launcher_started(env), run_ends(env))


def world_size_from_env(env: Mapping[str, str]) -> int:
    return int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)


def check_launcher_env(env: Mapping[str, str]) -> None:
    """A world that cannot be joined is bad input before anything starts: a RANK that is not a number, RANK
    without the rest of the world's variables, or Slurm's task variables in a batch script that forgot srun."""
    def or_unset(names: str) -> str:
        return f"or unset {names} (left over from another job?) and validate starts its own ranks"

    _check_slurm(env)
    if "RANK" not in env and "SLURM_PROCID" in env and _int(env.get("SLURM_NTASKS", "1"), 1) > 1 \
            and not any(name in env for name in SRUN_STEP_VARIABLES):
        raise ConfigError(f"SLURM_PROCID={env['SLURM_PROCID']} and SLURM_NTASKS={env['SLURM_NTASKS']} are set but "
                          "this process is not a task of srun (no SLURM_STEP_ID): expected srun to start one task "
                          "per GPU, found a batch script running validate directly; fix: put srun before the "
                          "command (srun python -m stackproof validate; scripts/slurm/validate.sbatch does), "
                          f"{or_unset('SLURM_PROCID and SLURM_NTASKS')}")
    if "RANK" not in env:
        return
    wrong = [f"{name}={env[name]!r}" for name in WHOLE_NUMBERS if name in env and _int(env[name], None) is None]
    if wrong:
        raise ConfigError(f"expected whole numbers, found {', '.join(wrong)}; fix: {UNDER_A_LAUNCHER}, "
                          f"{or_unset('RANK')}")
    missing = [name for name in WORLD_VARIABLES if not env.get(name)]
    if missing:
        raise ConfigError(f"RANK={env['RANK']} is set, so this process is one rank of a launcher's world, but "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; fix: "
                          f"{UNDER_A_LAUNCHER}, {or_unset('RANK')}")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank}: expected 0..{world - 1} (WORLD_SIZE={world}); fix: {UNDER_A_LAUNCHER}, "
                          f"{or_unset('RANK and WORLD_SIZE')}")


def _check_slurm(env: Mapping[str, str]) -> None:
    """Slurm's variables that adopt_slurm_env would make a world of, as srun sets them: whole numbers, the task
    inside the step, a node list that parses. Otherwise a rank waits out its rendezvous, silently."""
    fix = ("fix: start the ranks with srun (it sets SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST together), or "
           "unset them (left over from another job?) and validate starts its own ranks")
    wrong = [f"{name}={env[name]!r}" for name in SLURM_WHOLE_NUMBERS if name in env and _int(env[name], None) is None]
    if wrong:
        raise ConfigError(f"expected whole numbers, found {', '.join(wrong)}; {fix}")
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return  # nothing of Slurm's is adopted
    task, tasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    if not 0 <= task < tasks:
        raise ConfigError(f"SLURM_PROCID={task}: expected 0..{tasks - 1} (SLURM_NTASKS={tasks}); {fix}")
    for name in SLURM_NODELISTS:
        if env.get(name) and not HOSTLIST.fullmatch(env[name].strip()):
            raise ConfigError(f"{name}={env[name]!r}: expected Slurm's node list (n1,n2 or gpu[001-004,010]), "
                              f"found one that does not parse; {fix}")


def _int(text: str, default: int | None) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return default
