"""A warm start for the ranks of a one-node run: `stackproof warm-agent` is a resident, unprivileged process that
has imported torch, pytest and stackproof once (seconds) WITHOUT touching CUDA, and forks each rank from that
state on request (milliseconds). The launcher (launcher.py, through local_ranks.run) asks it over a local Unix
socket and starts the ranks cold, saying so, when no agent answers or it refuses the request.

Named `warm`, not `agent`: run/agent.py is torchrun's elastic agent (the multi-node launcher), a different thing.

Why fork is safe here: the agent never initialises CUDA (no context, no GPU memory, no driver threads; `status`
reports torch.cuda.is_initialized()), starts no threads, and each rank initialises CUDA itself after the fork,
exactly as a cold rank does after its import. A rank is the same program either way: `stackproof validate ARGV`
with the launcher's environment, working directory and stdout/stderr (passed over the socket), in a session of
its own. The agent serves only launchers of the same interpreter, import path and stackproof checkout, so the
code a warm rank runs is the code a cold one would import; anything else is refused and started cold. The
interpreter's start-up hooks (sitecustomize, usercustomize) run again in each rank with the rank's environment,
as they would at a cold rank's start. What torch reads from the environment at its import (the OpenMP runtime's
OMP_NUM_THREADS: set again per rank) comes from the agent's.

The protocol, one JSON object per line; one connection per rank:
    -> {"op": "rank", "argv", "env", "cwd", "same": {...}, "writable": [dirs]}  + stdout, stderr fds (SCM_RIGHTS),
       and the launcher's leaving pipe (local_ranks.LEAVING_FD_ENV) as a third when it has one
    <- {"pid": N} or {"refused": "why"}
    -> {"signal": N}                  (any time: the agent signals the rank's process group)
    <- {"exit": code}                 (when the rank has exited; -N: killed by signal N, as subprocess says)
A connection closed before the rank exits (the launcher died) makes the agent kill the rank's process group;
the agent dying kills its ranks (PR_SET_PDEATHSIG), and the launcher reads that as their exit by SIGKILL.
    -> {"op": "status"}   <- {"pid", "cuda_initialized", "cuda_driver_loaded", "cuda_driver_initialised",
                              "ranks": [pids], "same": {...}}
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from stackproof import environment
from stackproof.errors import ConfigError  # torch-free at import: run/config.py and the launcher read this

# Where the systemd unit's RuntimeDirectory puts it (deploy/systemd/stackproof-warm-agent.service).
DEFAULT_SOCKET = "/run/stackproof/warm.sock"
SOCKET_ENV = environment.WARM_SOCKET.name  # read as ValidateConfig.warm_socket's (run/config.py)
# How long the launcher waits for the agent's answer to a request before starting cold: it answers at once
# when idle, and a fork takes milliseconds.
ANSWER_TIMEOUT_S = 5.0
# The protocol below, as launcher and agent must share it (2: a rank request may hand over the leaving pipe). An
# agent started before an upgrade of the same checkout answers another one, and the launcher starts cold.
PROTOCOL = "2"
PR_SET_PDEATHSIG = 1
CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h's CUresult
# What a warm rank has loaded before its first check: what a cold rank imports (stackproof.cli and, through the
# worker, torch, torch.distributed and pytest), and what the suite's collection of the fast tier adds.
PRELOAD = ("stackproof.cli", "stackproof.run.launcher", "stackproof.run.worker", "stackproof.report.metrics",
           "pdb", "torch.nn.functional", "torch.distributed._functional_collectives", "torch.nn.parallel")
# And every module of these packages (the suite's collection imports them; none touches CUDA at import, which the
# agent checks after loading), and pytest's own plugins (each rank's session loads them).
PRELOAD_PACKAGES = ("stackproof.measure", "stackproof.judge")


def preload() -> None:
    """Import what a warm rank would otherwise import before its first check."""
    import pkgutil

    import _pytest.config

    for name in PRELOAD:
        importlib.import_module(name)
    for package in PRELOAD_PACKAGES:
        for found in pkgutil.iter_modules(importlib.import_module(package).__path__, f"{package}."):
            importlib.import_module(found.name)
    for plugin in _pytest.config.default_plugins:
        importlib.import_module(f"_pytest.{plugin}")


def sameness() -> dict[str, str]:
    """What must be equal between the launcher and the agent for a warm rank to run the code a cold one would."""
    import stackproof

    return {"python": os.path.realpath(sys.executable), "stackproof": str(Path(stackproof.__file__).resolve()),
            "pythonpath": environment.PYTHONPATH.get(), "protocol": PROTOCOL}


def cuda_driver_loaded() -> bool:
    """Whether this process has mapped the CUDA driver library (libcuda). A torch build may map it at import
    without initialising it; what breaks a fork is the initialisation (cuda_driver_initialised)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


def cuda_driver_initialised() -> bool:
    """Whether this process initialised the CUDA driver (cuInit, which any CUDA call makes, even one that makes no
    context, such as cudaGetDeviceCount or torch.cuda.is_available): a fork after it is broken. Asked of the
    library already mapped (RTLD_NOLOAD: none is loaded here): cuCtxGetCurrent answers CUDA_ERROR_NOT_INITIALIZED
    before cuInit and initialises nothing. A library that cannot be asked counts as initialised."""
    if not cuda_driver_loaded():
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        context = ctypes.c_void_p()
        return driver.cuCtxGetCurrent(ctypes.byref(context)) != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True


# ---------------------------------------------------------------------------------------------------------- agent


class Agent:
    """The resident process: one selector loop, no threads (fork-safe), one child per rank."""

    def __init__(self, path: str, entry: Callable[[list[str]], int], group: str | None = None):
        self.path, self.entry = path, entry  # entry: the CLI's main, which each rank runs with its argv
        self.group = group
        self.selector = selectors.DefaultSelector()
        self.ranks: dict[int, dict] = {}  # pid -> {"conn", "pidfd", "buffer"}
        self.same = sameness()
        self.stopping = False
        self.cwd = os.getcwd()  # `python -m` put it first on sys.path; a rank's is its launcher's

    def serve(self, ready: Callable[[str], None] = lambda _line: None) -> int:
        preload()
        import torch

        if torch.cuda.is_initialized() or cuda_driver_initialised():  # the forks would share CUDA's state: never
            raise ConfigError("CUDA was initialised in the warm agent while it loaded torch and stackproof (by a "
                              "sitecustomize, a .pth file or a library on its PYTHONPATH), so its ranks cannot be "
                              "forked from it; fix: start it from an environment that does not touch CUDA at import")
        listener = self._listen()
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGINT, lambda *_: self._stop())
        ready(f"# stackproof warm-agent: pid {os.getpid()}, torch {torch.__version__} imported (CUDA untouched), "
              f"listening on {self.path}")
        self.selector.register(listener, selectors.EVENT_READ, ("listen", None))
        agent_pid = os.getpid()
        try:
            while not self.stopping:
                for key, _ in self.selector.select(timeout=1.0):
                    kind, data = key.data
                    if kind == "listen":
                        self._accept(listener)
                    elif kind == "conn":
                        self._from_connection(key.fileobj, data)
                    elif kind == "rank":
                        self._reap(data)
        finally:
            if os.getpid() == agent_pid:  # never a forked rank's way out
                for pid in list(self.ranks):
                    _kill_group(pid, signal.SIGKILL)
                listener.close()
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        return 0

    def _stop(self) -> None:
        self.stopping = True

    def _listen(self) -> socket.socket:
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():  # a previous agent's, left behind by a kill: nobody listens there any more
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(self.path)
                    raise ConfigError(f"another warm agent listens on {self.path}; fix: stop it, or give this one "
                                      f"another --socket")
                except (ConnectionRefusedError, FileNotFoundError):
                    path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # srw-rw----: this user and its group only
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        if self.group:
            os.chown(self.path, -1, grp.getgrnam(self.group).gr_gid)
        listener.listen(64)
        listener.setblocking(False)
        return listener

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = listener.accept()
            conn.setblocking(True)
            conn.settimeout(ANSWER_TIMEOUT_S)
            self.selector.register(conn, selectors.EVENT_READ, ("conn", {"buffer": b"", "pid": None}))

    def _from_connection(self, conn: socket.socket, state: dict) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 4)
        except OSError:
            data, fds = b"", []
        if not data:  # the launcher left: a rank it started goes with it
            self.selector.unregister(conn)
            conn.close()
            for fd in fds:
                os.close(fd)
            if state["pid"] is not None and state["pid"] in self.ranks:
                _kill_group(state["pid"], signal.SIGKILL)
            return
        state["buffer"] += data
        while b"\n" in state["buffer"]:
            line, state["buffer"] = state["buffer"].split(b"\n", 1)
            self._request(conn, state, json.loads(line), fds)
            fds = []
        for fd in fds:
            os.close(fd)

    def _request(self, conn: socket.socket, state: dict, request: dict, fds: list[int]) -> None:
        if "signal" in request:
            if state["pid"] is not None:
                _kill_group(state["pid"], int(request["signal"]))
            return
        if request.get("op") == "status":
            import torch

            _send(conn, {"pid": os.getpid(), "cuda_initialized": torch.cuda.is_initialized(),
                         "cuda_driver_loaded": cuda_driver_loaded(),
                         "cuda_driver_initialised": cuda_driver_initialised(),
                         "ranks": sorted(self.ranks), "same": self.same,
                         "unwritable": self._unwritable(request.get("writable", []))})
            return
        why = self._refusal(request, fds)
        if why:
            for fd in fds:
                os.close(fd)
            _send(conn, {"refused": why})
            return
        pid = self._fork(request, fds)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.ranks[pid] = {"conn": conn, "pidfd": pidfd}
        state["pid"] = pid
        self.selector.register(pidfd, selectors.EVENT_READ, ("rank", pid))
        _send(conn, {"pid": pid})

    def _refusal(self, request: dict, fds: list[int]) -> str | None:
        if request.get("op") != "rank" or len(fds) not in (2, 3):
            return (f"expected a rank request with stdout, stderr (and a leaving pipe), found {sorted(request)} and "
                    f"{len(fds)} fd(s)")
        differ = [k for k, v in self.same.items() if request.get("same", {}).get(k) != v]
        if differ:
            return (f"the agent runs another {', '.join(differ)} ("
                    + "; ".join(f"{k}: agent {self.same[k]!r}, launcher {request.get('same', {}).get(k)!r}"
                                for k in differ) + "); fix: restart the agent from the launcher's environment")
        return self._unwritable(request.get("writable", []))

    @staticmethod
    def _unwritable(folders: list[str]) -> str | None:
        unwritable = [d for d in folders if not os.access(d, os.W_OK | os.X_OK)]
        if unwritable:
            return (f"the agent (uid {os.getuid()}) cannot write {', '.join(unwritable)}; fix: give the agent's "
                    "user or group write access there")
        return None

    def _fork(self, request: dict, fds: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        try:  # the rank: never returns
            if sys.path and sys.path[0] == self.cwd:
                sys.path[0] = request["cwd"]
            code = _become_rank(request, fds, self.selector, self.entry)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(int(code))

    def _reap(self, pid: int) -> None:
        entry = self.ranks.pop(pid)
        self.selector.unregister(entry["pidfd"])
        os.close(entry["pidfd"])
        _, status = os.waitpid(pid, 0)
        _kill_group(pid, signal.SIGKILL)  # what the rank started goes with it, as the cold launcher does
        with contextlib.suppress(OSError):
            _send(entry["conn"], {"exit": os.waitstatus_to_exitcode(status)})


def _become_rank(request: dict, fds: list[int], selector: selectors.BaseSelector,
                 entry: Callable[[list[str]], int]) -> int:
    """In the forked child: the launcher's environment, folder and output, then `stackproof validate ARGV`."""
    for key in list(selector.get_map().values()):  # the agent's sockets and pidfds are not the rank's
        with contextlib.suppress(OSError):
            (key.fileobj.close() if hasattr(key.fileobj, "close") else os.close(key.fileobj))
    for sig in (signal.SIGTERM, signal.SIGCHLD):  # as a fresh interpreter has them
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the agent's death is ours
    os.setsid()  # a session of its own, as the cold launcher gives a rank: its group is stopped as one
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for target, fd in zip((1, 2), fds[:2], strict=True):
        os.dup2(fd, target)
    os.close(null)
    leaving = fds[2:]  # the launcher's leaving pipe, under this process's own number for it
    for fd in fds[:2]:
        os.close(fd)
    os.chdir(request["cwd"])
    environment.replace(request["env"])
    from stackproof.run import local_ranks

    environment.forget(local_ranks.LEAVING_FD_ENV)  # the launcher's number for it is not this process's
    if leaving:
        environment.export({local_ranks.LEAVING_FD_ENV: str(leaving[0])})
    from stackproof.run import phases

    phases.reset()  # this process's own start (the fork), not the agent's
    for hook in ("sitecustomize", "usercustomize"):  # the interpreter's start-up hooks, with the rank's environment
        module = sys.modules.get(hook)
        if module is not None and getattr(module, "__file__", None):
            importlib.reload(module)
    phases.mark("torch_imported")  # already: the point of the agent
    threads = environment.OMP_NUM_THREADS.get()
    if threads and threads.isdigit():  # the OpenMP runtime read the agent's environment at its import
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = ["stackproof", *request["argv"]]
    return entry(list(request["argv"]))


def _kill_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


# --------------------------------------------------------------------------------------------------------- client


class WarmRank:
    """One rank forked by the agent, as local_ranks.run handles a subprocess.Popen: pid, poll(), wait(timeout),
    and signal_group() (through the agent: the launcher may be another user, or in another PID namespace)."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.returncode: int | None = None
        self._buffer = b""

    def _read(self, timeout_s: float | None) -> None:
        self.conn.settimeout(timeout_s)
        try:
            data = self.conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            data = b""
        if not data:  # the agent died: its ranks died with it (PR_SET_PDEATHSIG)
            self.returncode = -signal.SIGKILL
            return
        self._buffer += data
        while b"\n" in self._buffer and self.returncode is None:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.returncode = int(message["exit"])
                self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("warm rank", timeout or 0.0)
            self._read(left)
        return self.returncode

    def signal_group(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                _send(self.conn, {"signal": int(signum)})


class Unavailable(Exception):
    """No warm start: why, in words for the launcher's line."""


def _connect(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_TIMEOUT_S)
    try:
        conn.connect(path)
    except OSError as err:
        conn.close()
        raise Unavailable(f"no warm agent at {path} ({err.strerror or type(err).__name__})") from None
    return conn


def _answer(conn: socket.socket) -> dict:
    buffer = b""
    while b"\n" not in buffer:
        try:
            data = conn.recv(4096)
        except OSError as err:
            raise Unavailable(f"the warm agent did not answer ({err})") from None
        if not data:
            raise Unavailable("the warm agent closed the connection without an answer")
        buffer += data
    return json.loads(buffer.split(b"\n", 1)[0])


def status(path: str, writable: Sequence[str] = ()) -> dict:
    """The agent's own account: its pid, whether CUDA is initialised in it, the ranks it runs, and whether it
    can write `writable` (None, or why not)."""
    with contextlib.closing(_connect(path)) as conn:
        _send(conn, {"op": "status", "writable": list(writable)})
        return _answer(conn)


class Starter:
    """The launcher's side: start each rank through the agent at `path`. Raises Unavailable (before any rank is
    started) when the agent is absent or refuses, so the launcher starts the ranks cold instead."""

    def __init__(self, path: str, writable: Sequence[Path]):
        self.path, self.writable = path, [str(Path(d).resolve()) for d in writable]
        self.same = sameness()
        agent = status(path, self.writable)
        if agent.get("unwritable"):
            raise Unavailable(f"the warm agent at {path} refused: {agent['unwritable']}")
        differ = [k for k, v in self.same.items() if agent.get("same", {}).get(k) != v]
        if differ:
            raise Unavailable(f"the warm agent at {path} runs another {', '.join(differ)}; fix: restart it from "
                              "the launcher's environment")
        self.agent_pid = agent["pid"]

    def __call__(self, command: Sequence[str], env: dict[str, str], stdout: IO | None,
                 leaving: int | None = None) -> WarmRank:
        """Start `command` (python -m stackproof ARGV, what a cold rank runs) as a fork of the agent; `leaving`:
        the launcher's leaving pipe, handed to the rank (local_ranks.LEAVING_FD_ENV)."""
        entry = [sys.executable, "-m", "stackproof"]
        if list(command[:3]) != entry:
            raise ValueError(f"a warm rank runs {entry} ARGV, not {list(command)}")
        argv = list(command[3:])
        conn = _connect(self.path)
        out = stdout.fileno() if stdout is not None else sys.stdout.fileno()
        err = stdout.fileno() if stdout is not None else sys.stderr.fileno()
        request = {"op": "rank", "argv": list(argv), "env": env, "cwd": os.getcwd(), "same": self.same,
                   "writable": self.writable}
        fds = [out, err, *([] if leaving is None else [leaving])]
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        answer = _answer(conn)
        if "refused" in answer:
            conn.close()
            raise Unavailable(f"the warm agent refused: {answer['refused']}")
        return WarmRank(conn, int(answer["pid"]))


def starter(path: str, writable: Sequence[Path]) -> tuple[Starter | None, str]:
    """(the warm starter, or None for a cold start; the words for the launcher's line)."""
    try:
        start = Starter(path, writable)
    except Unavailable as why:
        return None, f"cold start: {why}"
    except (OSError, ValueError, KeyError) as err:
        return None, f"cold start: the warm agent at {path} answered unreadably ({type(err).__name__}: {err})"
    return start, f"warm start: ranks forked by the warm agent (pid {start.agent_pid}) at {path}"


def serve(path: str, group: str | None, out: IO[str], entry: Callable[[list[str]], int]) -> int:
    """`stackproof warm-agent`: serve until SIGTERM, then leave at once (torch's teardown at exit takes seconds
    and holds nothing the agent needs). `entry`: the CLI's main, handed down by the CLI."""
    code = Agent(path, entry, group).serve(lambda line: print(line, file=out, flush=True))
    out.flush()
    os._exit(code)
