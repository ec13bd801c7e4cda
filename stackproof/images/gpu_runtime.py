"""Can this Docker engine give a container GPUs the way GPU_FLAGS asks? `make test-gpu` asks before it runs, so a
host without the NVIDIA Container Toolkit gets what was expected, what was found and the fix, instead of
Docker's `could not select device driver "" with capabilities: [[gpu]]`.

    python -m stackproof.images.gpu_runtime "--gpus all"      # exit 0, or 2 with the message
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from stackproof import environment
from stackproof.errors import ConfigError

DOCKER_TIMEOUT_S = 30
# `--gpus` is served by the NVIDIA device driver, which dockerd registers when it finds this hook on its PATH
# (or, from Docker 28.3, nvidia-cdi-hook with a CDI spec of nvidia.com/gpu).
RUNTIME_HOOK = "nvidia-container-runtime-hook"
CDI_HOOK = "nvidia-cdi-hook"
GPU_CDI_KIND = "nvidia.com/gpu"
_YAML_KIND = re.compile(r"^kind:\s*[\"']?([^\"'\s#]+)", re.MULTILINE)
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FIX = ("fix: install the NVIDIA Container Toolkit on the Docker host and run `nvidia-ctk runtime configure "
       "--runtime=docker`, then restart dockerd; or with CDI: `nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml` "
       "and GPU_FLAGS='--device nvidia.com/gpu=all'. To run on the CPU on purpose: "
       "make test-gpu GPU_FLAGS= ARGS='validate --expect-gpus 0'")


def engine_info(docker: str = "docker") -> dict:
    """`docker info` as JSON; a ConfigError when the engine does not answer."""
    try:
        proc = subprocess.run([docker, "info", "--format", "{{json .}}"], capture_output=True, text=True,
                              timeout=DOCKER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"`{docker} info` did not answer within {DOCKER_TIMEOUT_S} s ({err}); "
                          "fix: start the engine (scripts/ci/docker-engine.sh)") from None
    if proc.returncode != 0:
        raise ConfigError(f"`{docker} info` failed: {proc.stderr.strip()}; fix: start the engine "
                          "(scripts/ci/docker-engine.sh)")
    return json.loads(proc.stdout)


def _engine_is_local() -> bool:
    host = environment.DOCKER_HOST.get()
    return not host or host.startswith("unix://")


def _on_daemon_path(program: str) -> bool:
    return shutil.which(program, path=f"{environment.PATH.get()}:{DAEMON_PATH}") is not None


def cdi_kinds(info: dict) -> set[str]:
    """Device kinds (e.g. nvidia.com/gpu) declared by the CDI specs in the engine's CDI spec directories."""
    kinds = set()
    for device in info.get("DiscoveredDevices") or []:  # Docker >= 28.3 lists them itself
        if device.get("Source") == "cdi":
            kinds.add(device.get("ID", "").split("=", 1)[0])
    for directory in info.get("CDISpecDirs") or []:
        for spec in sorted(Path(directory).glob("*")):
            if spec.suffix == ".json":
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    kinds.add(json.loads(spec.read_text()).get("kind", ""))
            elif spec.suffix in (".yaml", ".yml"):
                with contextlib.suppress(OSError):
                    # `kind` is a top-level key of every CDI spec.
                    kinds.update(m.group(1) for m in _YAML_KIND.finditer(spec.read_text(errors="replace")))
    kinds.discard("")
    return kinds


def _flag_values(flags: list[str], name: str) -> list[str]:
    """The values of `name` in a docker run command line, in both spellings (--gpus all, --gpus=all)."""
    values = [value for flag, value in itertools.pairwise(flags) if flag == name]
    return values + [flag.split("=", 1)[1] for flag in flags if flag.startswith(name + "=")]


def problem(gpu_flags: str, info: dict, local: bool = True, on_path=_on_daemon_path) -> str | None:
    """Why `docker run GPU_FLAGS` cannot get GPUs from this engine, or None. Remote engines: only what
    `docker info` shows is checked (the hook lives on a machine we cannot see)."""
    flags = shlex.split(gpu_flags)
    if not flags:
        return None
    runtimes = sorted(info.get("Runtimes") or {})
    kinds = cdi_kinds(info)
    cdi_dirs = ", ".join(info.get("CDISpecDirs") or []) or "none (CDI disabled)"
    found = (f"runtimes {', '.join(runtimes)}; CDI kinds {', '.join(sorted(kinds)) or 'none'} "
             f"(spec dirs: {cdi_dirs})")
    for device in _flag_values(flags, "--device"):
        kind = device.split("=", 1)[0]
        if "=" not in device or "/" not in kind:  # a device node (/dev/...), not a CDI name
            continue
        if kind not in kinds:
            return (f"GPU_FLAGS='{gpu_flags}' asks for the CDI device {device}, but the Docker engine knows no CDI "
                    f"kind {kind}: found {found}; {FIX}")
    for runtime in _flag_values(flags, "--runtime"):
        if runtime not in runtimes:
            return f"GPU_FLAGS='{gpu_flags}' asks for the runtime {runtime!r}, but the Docker engine has {found}; {FIX}"
    if _flag_values(flags, "--gpus"):
        hooked = on_path(RUNTIME_HOOK) or (on_path(CDI_HOOK) and GPU_CDI_KIND in kinds)
        if "nvidia" in runtimes or not local or hooked:
            return None
        return (f"GPU_FLAGS='{gpu_flags}' needs the NVIDIA Container Toolkit in the Docker engine: expected "
                f"{RUNTIME_HOOK} on the host (or the 'nvidia' runtime, or a CDI spec of {GPU_CDI_KIND}); found "
                f"no {RUNTIME_HOOK} on PATH, {found}; {FIX}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    gpu_flags = args[0] if args else ""
    try:
        if not shlex.split(gpu_flags):
            return 0
        found = problem(gpu_flags, engine_info(), local=_engine_is_local())
    except ConfigError as err:
        print(f"test-gpu: {err}", file=sys.stderr)
        return err.exit_code
    if found:
        print(f"test-gpu: {found}", file=sys.stderr)
        return ConfigError.exit_code
    if not _engine_is_local():
        print(f"test-gpu: note: DOCKER_HOST={environment.DOCKER_HOST.get()} is remote: {RUNTIME_HOOK} could not be "
              "looked for there; docker run will say if GPUs cannot be given", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
