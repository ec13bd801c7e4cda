"""The ranks of a run and how they agree.

A rank joins from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT), from Slurm's (SLURM_PROCID, ...)
or, with neither, as a world of one. Cross-rank agreement is O(world) messages through rank 0's store: every
rank posts its value, rank 0 alone reads them all (one wait, one multi-get), decides, and posts one answer that
every rank reads. Every wait has a timeout, and a rank that does not arrive is named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stackproof import environment
from stackproof.errors import RankTimeout
from stackproof.run import phases
from stackproof.run.launch_env import adopt_slurm_env, launched_by_a_launcher, world_size_from_env

__all__ = ["DistEnv", "adopt_slurm_env", "init", "launched_by_a_launcher", "shutdown", "world_size_from_env"]

R = TypeVar("R")
# Ranks other than 0 wait this much longer for rank 0's answer than rank 0 waits for them, so that rank 0's
# "rank(s) [...] did not arrive" reaches them before their own, vaguer timeout.
ANSWER_GRACE_S = 30.0
# On a NCCL timeout, abort the communicator but keep the process: PyTorch's default (1) kills the waiting rank
# first, before stackproof's watchdog (watchdog.py) can say which rank stalled it (seen on H200s).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
# The suite never leaves a CUDA-graph launch outstanding when it next calls NCCL eagerly (bandwidth.py syncs after
# every replay), NCCL's condition for turning its graph-mixing support off; with it on, a captured all_reduce
# replays at 11 us instead of 4.9 us on H200s (nccl-tests -G: 5.9 us), which would hide the link's latency.
NCCL_GRAPH_MIXING = ("NCCL_GRAPH_MIXING_SUPPORT", "0")


@dataclasses.dataclass
class DistEnv:
    rank: int
    world_size: int
    store: dist.Store
    timeout_s: float
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    backend: str = "gloo"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # A second connection to the same store, for the watchdog thread: a client connection is busy while the
    # main thread waits on it.
    side_store: dist.Store | None = None
    node: str = ""  # this node's name as the run resolved it (--node-name, else the scheduler's, else the host's)
    _seq: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def gpu_index(self) -> int | None:
        """This rank's GPU (the index a finding names), None on a CPU rank."""
        return self.device.index if self.is_gpu else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(1, self.local_world_size)))

    def agree(self, mine: Any, what: str, decide: Callable[[list[Any]], R]) -> R:
        """Every rank hands in a JSON-able `mine`; rank 0 calls `decide(values in rank order)` and every rank
        returns its (JSON-able) answer. Raises RankTimeout naming the ranks that did not arrive."""
        self._seq += 1
        prefix = f"sync/{self._seq}/"
        if self.is_main:
            answer = self._decide(prefix, mine, decide)
            self.store.set(prefix + "answer", json.dumps(answer))
        else:
            try:  # a blocking get: this store's own timeout is --timeout + ANSWER_GRACE_S (see init)
                # The set too: rank 0 gone before this rank handed in is its store gone, never a traceback.
                self.store.set(prefix + str(self.rank), json.dumps(mine))
                raw = self.store.get(prefix + "answer")
            except (RuntimeError, OSError) as err:  # DistStoreError: a timeout; DistNetworkError: rank 0's store gone
                said = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                waited = self.timeout_s + ANSWER_GRACE_S
                why = (f"no answer within {waited:.0f} s (hung or dead; raise the limit with --timeout)"
                       if isinstance(err, dist.DistStoreError) else "its store went away (rank 0 died?)")
                raise RankTimeout(f"rank 0 did not answer {what}: {why}: {type(err).__name__}: {said}; see its "
                                  "log (<reports>/logs/rank0.log)", [0]) from err
            answer = json.loads(raw)
        if "missing" in answer:
            raise RankTimeout(f"rank(s) {answer['missing']} did not finish {what} within {self.timeout_s:.0f} s "
                              "(hung or dead); see their logs (<reports>/logs/rank<N>.log); raise the limit with "
                              "--timeout", answer["missing"])
        if "error" in answer:
            raise RuntimeError(f"rank 0 could not decide {what}: {answer['error']}")
        return answer["value"]

    def _decide(self, prefix: str, mine: Any, decide: Callable[[list[Any]], Any]) -> dict[str, Any]:
        keys = [prefix + str(r) for r in range(1, self.world_size)]
        try:
            if keys:
                self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:
            # Only on failure: one check per rank, to name the ones that never arrived.
            return {"missing": [r for r, key in enumerate(keys, 1) if not self.store.check([key])]}
        values = [mine, *(json.loads(v) for v in (self.store.multi_get(keys) if keys else []))]
        try:
            return {"value": decide(values)}
        except Exception as err:  # every rank must hear an answer, or they all wait out the timeout
            return {"error": f"{type(err).__name__}: {err}"}

    def gather(self, mine: Any, what: str) -> list[Any] | None:
        """Every rank's value on rank 0 (in rank order); None elsewhere. O(world) messages."""
        box: list[list[Any]] = []
        self.agree(mine, what, lambda values: box.append(values))
        return box[0] if self.is_main else None

    def barrier(self, what: str) -> None:
        self.agree(None, what, lambda _values: None)

    def leave(self) -> None:
        """The last step before the process exits. Rank 0 hosts the store (env:// rendezvous): it leaves only once
        every other rank has read the last answer and said so (or --timeout passed), else a rank still reading
        finds the store gone and takes the end of the run for a dead rank 0."""
        if not self.is_main:
            with contextlib.suppress(Exception):  # rank 0 gone already: nothing is waiting for this
                self.store.set(f"left/{self.rank}", "1")
            return
        keys = [f"left/{r}" for r in range(1, self.world_size)]
        if keys:
            with contextlib.suppress(Exception):  # a rank that never says so is already named, or gone
                self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))


def init(rendezvous_timeout_s: float, timeout_s: float, node: str = "") -> DistEnv:
    """Join the world (or make a world of one) and create the default process group: NCCL on GPUs, gloo on CPU.
    The world is the one the launcher put in the environment (read here, through stackproof/environment.py, and
    written back for torch's env:// rendezvous); `node`: this node's name as the run resolved it."""
    env = dict(environment.current())
    adopt_slurm_env(env)
    # Set where every rank starts (our launcher, torchrun, srun, Kubernetes alike); a user's own choice stands.
    env.setdefault(*NCCL_ERROR_HANDLING)
    env.setdefault(*NCCL_GRAPH_MIXING)
    if not launched_by_a_launcher(env):
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    environment.export(env)
    local_rank = int(environment.LOCAL_RANK.get(env))
    # The CUDA context first: its set-up overlaps with the other ranks' start-up, which the rendezvous waits for.
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # creates the context (CUDA >= 12)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    phases.mark("cuda_ready")
    store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=rendezvous_timeout_s)))
    local_world_size = int(environment.LOCAL_WORLD_SIZE.get(env) or world_size)
    node_rank = int(environment.GROUP_RANK.get(env) or rank // max(1, local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    # NCCL's communicator up front (device_id) where it has peers: failures show here, and sub-groups split from it.
    # A world of one has none to join: a check that uses NCCL makes it then (0.3 s off a one-GPU healthcheck).
    eager = backend == "nccl" and world_size > 1
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if eager else None)
    phases.mark("process_group_ready")

    def connection(timeout_s: float) -> dist.Store:
        """A connection of stackproof's own to rank 0's store: the agreement's (a blocking get waits as long
        as its timeout) and the watchdog's (it must not queue behind the main thread's wait)."""
        client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore("stackproof", client)

    return DistEnv(rank, world_size, connection(timeout_s + ANSWER_GRACE_S), timeout_s, local_rank, local_world_size,
                   node_rank, backend, device, side_store=connection(rendezvous_timeout_s), node=node)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
