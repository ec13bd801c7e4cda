"""Who this rank is, its process group, and a cross-rank sync that names the ranks that never arrived.

Ranks come from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), from Slurm (SLURM_PROCID, ...)
or, with neither, a world of one. Every wait has the configured timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import socket

import torch
import torch.distributed as dist

from stackproof.errors import StackproofError


class RankTimeout(StackproofError):
    """Some ranks did not reach a sync point in time: the run cannot go on."""

    exit_code = 4


def adopt_slurm_env(env: dict[str, str]) -> None:
    """Under `srun` (one task per GPU) map Slurm's variables onto torch's, unless torchrun already set them."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
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


def launched_by_a_launcher(env: dict[str, str] | os._Environ = os.environ) -> bool:
    return "RANK" in env or ("SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1)


@dataclasses.dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    store: dist.Store
    # A second connection to the same store, for the watchdog thread: a client connection is busy while the
    # main thread waits on it.
    side_store: dist.Store | None = None
    _sync_seq: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def exchange(self, value: object, what: str) -> list[object]:
        """Every rank's JSON-able `value`, in rank order, through the store; names missing ranks on timeout."""
        self._sync_seq += 1
        prefix = f"sync/{self._sync_seq}/"
        self.store.set(prefix + str(self.rank), json.dumps(value))
        keys = [prefix + str(r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # a store timeout raises DistStoreError / RuntimeError depending on the version
            missing = [r for r in range(self.world_size) if not self.store.check([prefix + str(r)])]
            raise RankTimeout(
                f"rank(s) {missing} did not finish {what} within {self.timeout_s:.0f} s (hung or dead); "
                f"see their logs (<reports>/logs/rank<N>.log); raise the limit with --timeout") from None
        return [json.loads(self.store.get(key)) for key in keys]

    def agree(self, mine: object, what: str, decide):  # TEMP until main's agree lands
        return json.loads(json.dumps(decide(self.exchange(mine, what))))

    def barrier(self, what: str) -> None:
        self.exchange(None, what)


def init(timeout_s: float) -> DistEnv:
    """Join the world (or make a world of one) and create the default process group: NCCL on GPUs, gloo on CPU."""
    adopt_slurm_env(os.environ)  # type: ignore[arg-type]
    if not launched_by_a_launcher():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if backend == "nccl" else None)
    side = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, backend, device, timeout_s,
                   dist.PrefixStore("stackproof", store), dist.PrefixStore("stackproof", side))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
