"""The environment stackproof reads, in one place. Every variable read by name is declared here once, with what
it means and its default; an entry point reads what it needs here, once, and hands the values (or, where a pure
function takes a launcher's whole environment as data, `current()`) down. No part of ours talks to another
through a variable or a file: what the launcher tells a rank is a declared variable of the rank, read where the
rank reads its settings. Settings' own variables (`option(env=...)`, settings.py) are read through here too.

tests/test_environment.py holds every other module to it: none reads os.environ or os.getenv. Handing the whole
environment on to a child process (`env=os.environ`, `{**os.environ, ...}`) is not a read and stays where it is;
so is writing the variables a library loaded here reads (NCCL, torch's env:// rendezvous): `export`."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Variable:
    """An environment variable stackproof reads: its name, what it means, its value when unset."""
    name: str
    means: str
    default: str | None = None

    def get(self, env: Mapping[str, str] | None = None) -> str | None:
        """Its value in `env` (a launcher's environment handed down as data), else in this process's."""
        return (current() if env is None else env).get(self.name, self.default)


def current() -> Mapping[str, str]:
    """This process's environment as whoever started it set it, read-only: for the pure functions that take a
    launcher's environment as data (launch_env's checks, the pins an image declares, the scheduler's GPU count)."""
    return types.MappingProxyType(os.environ)  # type: ignore[arg-type]


def inherited(without: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of this process's environment for a child, less `without` and the names starting with `prefixes`."""
    return {k: v for k, v in os.environ.items() if k not in without and not (prefixes and k.startswith(prefixes))}


def export(values: Mapping[str, str], *, keep_set: bool = False) -> None:
    """Set variables that a library in this process reads (NCCL, torch.distributed's env://); `keep_set`: a value
    already set (the user's own choice) stands."""
    for name, value in values.items():
        if keep_set:
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value


def forget(*names: str) -> dict[str, str]:
    """Take these variables out of this process's environment (no child of it sees them); the values they had."""
    return {name: os.environ.pop(name) for name in names if name in os.environ}


def replace(values: Mapping[str, str]) -> None:
    """Become a process with exactly this environment (a warm agent's fork takes on the rank's)."""
    os.environ.clear()
    os.environ.update(values)


# --- What stackproof's launcher tells its ranks (declared here so that a rank reads it as a setting of its own).
LAUNCHED = Variable("STACKPROOF_LAUNCHED", "set by whoever started the ranks and settles the verdict afterwards (the "
                                           "launcher: its start, epoch seconds; scripts/torchrun, scripts/slurm: 1); "
                                           "a rank then exits 0 whenever its checks ran")
RUN_ENDS = Variable("STACKPROOF_RUN_ENDS", "set by stackproof's launcher: when it stops the ranks (epoch seconds)")
LEAVING_FD = Variable("STACKPROOF_LEAVING_FD", "set by stackproof's launcher: the write end of the pipe a rank says "
                                              "it leaves on (run/local_ranks.py); taken out at the rank's start")
NODE_NAME = Variable("STACKPROOF_NODE_NAME", "this node's name as the scheduler knows it (Kubernetes' downward API); "
                                             "--node-name's variable")
REPORTS = Variable("STACKPROOF_REPORTS", "the reports folder; --reports' variable")
WARM_SOCKET = Variable("STACKPROOF_WARM_SOCKET", "where the warm agent listens; --warm-socket's variable")

# --- What a launcher (torchrun, srun, Kubernetes) tells a rank: its place in the world.
RANK = Variable("RANK", "this process's rank in its world (torchrun; srun through launch_env.adopt_slurm_env)")
WORLD_SIZE = Variable("WORLD_SIZE", "the number of ranks in the world")
LOCAL_RANK = Variable("LOCAL_RANK", "this rank's index on its node (its GPU)", "0")
LOCAL_WORLD_SIZE = Variable("LOCAL_WORLD_SIZE", "the ranks on this node")
GROUP_RANK = Variable("GROUP_RANK", "this node's index among the world's nodes (torchrun's)")
MASTER_ADDR = Variable("MASTER_ADDR", "the host of rank 0's store")
MASTER_PORT = Variable("MASTER_PORT", "the port of rank 0's store")
SLURMD_NODENAME = Variable("SLURMD_NODENAME", "the node's name, as Slurm sets it in every task")

# --- The host's and the libraries' own, read where we follow them.
CUDA_VISIBLE_DEVICES = Variable("CUDA_VISIBLE_DEVICES", "the GPUs CUDA shows this process (all when unset)")
NCCL_DEBUG = Variable("NCCL_DEBUG", "NCCL's log level; when the caller set it, stackproof leaves NCCL's log alone")
NCCL_DEBUG_FILE = Variable("NCCL_DEBUG_FILE", "where NCCL writes its log (%h: host, %p: pid)")
PYTEST_ADDOPTS = Variable("PYTEST_ADDOPTS", "pytest's extra options: refused (the suite runs its own pytest)", "")
PYTHONPATH = Variable("PYTHONPATH", "the interpreter's module path: a warm agent's must be the launcher's", "")
OMP_NUM_THREADS = Variable("OMP_NUM_THREADS", "OpenMP's threads (a warm rank applies the rank's own)")
PATH = Variable("PATH", "where programs are looked up", "")
DOCKER_HOST = Variable("DOCKER_HOST", "the Docker daemon the image commands talk to (local when unset)", "")
XDG_CACHE_HOME = Variable("XDG_CACHE_HOME", "the user's cache folder (~/.cache when unset)")
CA_BUNDLES = (Variable("SSL_CERT_FILE", "a CA bundle for HTTPS (the first set wins)"),
              Variable("PIP_CERT", "pip's CA bundle"), Variable("REQUESTS_CA_BUNDLE", "requests' CA bundle"))
COSIGN_PASSWORD = Variable("COSIGN_PASSWORD", "the cosign key's password (cosign reads it too)", "")
