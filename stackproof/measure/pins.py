"""What actually runs (versions, and the file each native library was loaded from) and what was promised
(the image's expected.json and lock, a matrix entry, an expect file, or an image's own ENV declarations)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path

from packaging.utils import canonicalize_name

from stackproof.errors import ConfigError

IMAGE_EXPECTED = Path("/etc/stackproof/expected.json")
IMAGE_LOCK = Path("/etc/stackproof/lock.txt")
COMPONENTS = ("python", "torch", "torchvision", "cuda", "cudnn", "nccl")
# How other images declare their stack (NGC, nvidia/cuda, pytorch/pytorch), first match wins.
DECLARED_ENV = {
    "torch": ("PYTORCH_VERSION", "TORCH_VERSION"),
    "cuda": ("CUDA_VERSION",),
    "cudnn": ("CUDNN_VERSION", "NV_CUDNN_VERSION"),
    "nccl": ("NCCL_VERSION", "NV_LIBNCCL_PACKAGE_VERSION"),
    "torchvision": ("TORCHVISION_VERSION",),
    "python": ("PYTHON_VERSION",),
}
_LIBS = {"nccl": "libnccl.so", "cudnn": "libcudnn.so", "cudart": "libcudart.so", "torch_cuda": "libtorch_cuda.so"}


@dataclasses.dataclass
class Expected:
    versions: dict[str, str]
    source: str
    flavor: str | None = None
    lock: Path | None = None

    @property
    def undeclared(self) -> list[str]:
        return [c for c in COMPONENTS if c not in self.versions]


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_versions() -> dict[str, str | None]:
    """torch's versions as the running torch reports them; torchvision's from its installed metadata, the same
    string as its __version__ (importing it costs each rank seconds of the fast tier: the full tier's
    libraries::torchvision_ops imports and runs it)."""
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        nccl = None
    return {
        "python": ".".join(platform.python_version_tuple()[:2]),
        "torch": torch.__version__,
        "torchvision": _installed("torchvision"),
        "cuda": torch.version.cuda,
        # 92400 -> 9.24.0 (cuDNN 9 encodes major*10000 + minor*100 + patch)
        "cudnn": f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}" if cudnn else None,
        "nccl": nccl,
    }


def loaded_libraries() -> dict[str, str]:
    """{'nccl': '/path/libnccl.so.2', ...}: the files this process mapped, from /proc/self/maps."""
    found: dict[str, str] = {}
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return found
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        for name, stem in _LIBS.items():
            if name not in found and Path(path).name.startswith(stem):
                found[name] = path
    return found


def locked_versions(lock: Path) -> dict[str, str]:
    """{normalized name: version} of the image's lock (images/locks/, carried at /etc/stackproof/lock.txt)."""
    # Imported here: the lock tooling brings the package index (urllib, ssl) with it, 0.1 s of every launcher's and
    # rank's start on an H200 where no lock is read.
    from stackproof.images.locks import read_lock

    return read_lock(lock)[1]


def installed_versions() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
            if d.metadata["Name"]}


def expected(expect_file: str | None, image: str | None, env: dict[str, str] | os._Environ,
             declared_env: bool = False) -> Expected:
    """The promise to check against, from the most specific source available. Raises ConfigError (exit 2) for
    a file or image that cannot be read."""
    if expect_file:
        return _from_file(Path(expect_file), f"--expect-file {expect_file}")
    if image:
        from stackproof.images.matrix import load_matrix  # needs the repo's images/ (a host checkout)

        entry = load_matrix().get(image)  # an unknown name: ConfigError naming the known ones
        return Expected(entry.pins(), f"images/matrix.toml image {image!r}", entry.flavor, entry.lock_path)
    if IMAGE_EXPECTED.exists():
        return _from_file(IMAGE_EXPECTED, f"{IMAGE_EXPECTED} (baked into the image)")
    if not declared_env:
        # Only inside a validation layer (--expect-declared): on a bare host these variables often describe system
        # libraries torch never loads.
        return Expected({}, "nothing declared (inside a validation layer, --expect-declared reads the image's ENV)")
    declared = {}
    for component, names in DECLARED_ENV.items():
        for name in names:
            if env.get(name):
                # NV_LIBNCCL_PACKAGE_VERSION reads like 2.21.5-1+cuda12.4
                declared[component] = env[name].split("-")[0]
                break
    source = f"the image's ENV ({', '.join(f'{c}={v}' for c, v in declared.items())})" if declared else \
        "nothing declared by the image's ENV"
    return Expected(declared, source)


def _from_file(path: Path, source: str) -> Expected:
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"{source}: expected a readable JSON file of versions, found {err.strerror or err}; "
                          "fix: pass an existing file (keys: " + ", ".join(COMPONENTS) + ")") from None
    except ValueError as err:
        raise ConfigError(f"{source}: expected JSON, found invalid JSON ({err}); fix the file") from None
    if not isinstance(data, dict) or not any(data.get(c) for c in COMPONENTS):
        raise ConfigError(f"{source}: expected an object with at least one of {', '.join(COMPONENTS)}, found "
                          f"{str(data)[:200]}; fix the file")
    versions = {c: str(data[c]) for c in COMPONENTS if data.get(c)}
    lock = Path(data["lock"]) if data.get("lock") else (IMAGE_LOCK if IMAGE_LOCK.exists() else None)
    return Expected(versions, source, data.get("flavor"), lock)


def image_description() -> dict[str, object]:
    """What the running image says of itself: its promise (expected.json, the same values as its labels)."""
    try:
        return {"expected": json.loads(IMAGE_EXPECTED.read_text()), "source": str(IMAGE_EXPECTED)}
    except (OSError, ValueError):
        return {}


def system_nccl() -> tuple[str, str] | None:
    """(path, version) of the libnccl the dynamic linker would find outside Python, if any."""
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in cache.splitlines():
        if "libnccl.so.2 " in line and "=>" in line:
            path = os.path.realpath(line.split("=>")[1].strip())
            match = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)$", path)
            if match:
                return path, match.group(1)
    return None
