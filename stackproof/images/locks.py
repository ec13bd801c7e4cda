"""Hashed requirement locks, generated from the matrix with uv, and the check that the matrix, each lock and
torch's own wheel metadata agree on torch, torchvision, CUDA, cuDNN and NCCL."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from stackproof.errors import ConfigError
from stackproof.images import index as package_index
from stackproof.images import metadata as wheel_meta
from stackproof.images.matrix import LOCKS_DIR, MATRIX_PATH, Image, Matrix

# The platform uv locks for: the images' CPU and libc floor (torch's own Linux wheels are manylinux_2_28 x86_64).
LOCK_PLATFORM = f"{wheel_meta.ARCH}-manylinux_2_{wheel_meta.GLIBC_MINOR}"
# Oldest Python the validation layer must install into (any existing PyTorch image, too).
VALIDATION_PYTHON_FLOOR = "3.10"
VALIDATION_LOCK = LOCKS_DIR / "validation.txt"
VALIDATION_REQUIREMENTS = ("pytest", "nvidia-ml-py")
UV_TIMEOUT_S = 600

_HEADER = "# stackproof lock: image={name} python={python} platform={platform}"
_HEADER_RE = re.compile(r"^# stackproof lock: image=(\S+) python=(\S+) platform=(\S+)$")
_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Index pages fetched at once by the online hash check (one per package of a lock).
INDEX_THREADS = 8

# How each pinned component shows up among torch's requirements (and so in a lock).
_COMPONENT_PACKAGES: dict[str, re.Pattern[str]] = {
    "cuda": re.compile(r"^(cuda-toolkit|nvidia-cuda-runtime(-cu\d+)?)$"),
    "cudnn": re.compile(r"^nvidia-cudnn-cu\d+$"),
    "nccl": re.compile(r"^nvidia-nccl-cu\d+$"),
}


def _uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        raise ConfigError("uv not found: locks are generated with uv; fix: pip install uv (or pip install -e '.[dev]')")
    return uv


def _compile(requirements: Iterable[str], output: Path, header: str, extra_args: list[str]) -> None:
    cmd = [_uv(), "pip", "compile", "-", "--generate-hashes", "--quiet", "--no-annotate",
           "--custom-compile-command", "make lock", "--output-file", str(output), *extra_args]
    try:
        subprocess.run(cmd, input="\n".join(requirements) + "\n", text=True, check=True, timeout=UV_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        raise ConfigError(f"{output.name}: uv could not resolve {list(requirements)} (exit {err.returncode}); "
                          "see uv's message above") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{output.name}: uv took over {UV_TIMEOUT_S} s; is PyPI reachable?") from None
    output.write_text(header + "\n" + output.read_text())


def parent_lock(image: Image) -> Path:
    """A lab image's 'from' lock: the runtime it is installed over."""
    return LOCKS_DIR / f"{image.parent}.txt"


def lock_image(image: Image) -> Path:
    """Write images/locks/<name>.txt: torch and torchvision with every dependency, pinned and hashed.
    A lab lock is the whole environment of its image (the runtime's lock + the validation tools + JupyterLab),
    constrained to the versions already installed below it, so installing it over them changes nothing."""
    image.lock_path.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.format(name=image.name, python=image.python, platform=LOCK_PLATFORM)
    requirements = [f"torch=={image.torch}", f"torchvision=={image.torchvision}"]
    extra = ["--python-version", image.python, "--python-platform", LOCK_PLATFORM]
    if image.flavor == "lab":
        requirements += [*VALIDATION_REQUIREMENTS, f"jupyterlab=={image.jupyterlab}"]
        extra += ["--constraint", str(parent_lock(image)), "--constraint", str(VALIDATION_LOCK)]
    _compile(requirements, image.lock_path, header, extra)
    return image.lock_path


def lock_files(image: Image, layer: str = "runtime") -> list[Path]:
    """The locks whose packages make up `image` (layer 'validation': its validation image)."""
    if image.flavor == "lab":
        return [image.lock_path]  # complete: the runtime's and validation's pins are in it
    return [image.lock_path, VALIDATION_LOCK] if layer == "validation" else [image.lock_path]


def lock_digest(image: Image, layer: str = "runtime") -> str:
    """sha256 over the content of lock_files(): what the immutable tag names, so a new lock is a new tag."""
    digest = hashlib.sha256()
    for path in lock_files(image, layer):
        if not path.exists():
            raise ConfigError(f"images/locks/{path.name}: missing; fix: make lock")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def lock_validation() -> Path:
    """Write images/locks/validation.txt: the validation layer's tools, for any Python the images may have."""
    header = _HEADER.format(name="validation", python=f">={VALIDATION_PYTHON_FLOOR}", platform="universal")
    _compile(VALIDATION_REQUIREMENTS, VALIDATION_LOCK, header,
             ["--universal", "--python-version", VALIDATION_PYTHON_FLOOR])
    return VALIDATION_LOCK


@dataclasses.dataclass(frozen=True)
class Locked:
    """One requirement of a lock: where it starts, what it says, and its --hash options as written."""

    line: int
    text: str
    requirement: Requirement | None
    hashes: tuple[str, ...]
    hash_lines: tuple[int, ...]

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name) if self.requirement else self.text

    @property
    def version(self) -> str | None:
        """The version of an exact `==` pin (the only kind a hashed lock may have), else None."""
        specs = list(self.requirement.specifier) if self.requirement else []
        return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def _lock_name(path: Path) -> str:
    return f"images/locks/{path.name}" if path.parent.name == "locks" else str(path)


def parse_lock(path: Path) -> tuple[dict[str, str], list[Locked]]:
    """(header fields, requirements) of a lock file written by `make lock` (uv pip compile --generate-hashes)."""
    if not path.exists():
        raise ConfigError(f"{_lock_name(path)}: missing; fix: make lock")
    lines = path.read_text().splitlines()
    header = _HEADER_RE.match(lines[0]) if lines else None
    if not header:
        raise ConfigError(f"{_lock_name(path)}: first line is not a stackproof lock header; fix: make lock")
    entries, start, words = [], 0, []
    for number, line in enumerate(lines, 1):
        text = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0].strip()
        if not text and not words:
            continue
        if not words:
            start = number
        words += [(word, number) for word in text.removesuffix("\\").split()]
        if text.endswith("\\"):
            continue
        hashes = [(w.removeprefix("--hash="), n) for w, n in words if w.startswith("--hash=")]
        requirement_text = " ".join(w for w, _ in words if not w.startswith("--hash="))
        words = []
        try:
            requirement = Requirement(requirement_text)
        except InvalidRequirement:
            requirement = None
        entries.append(Locked(start, requirement_text, requirement, tuple(h for h, _ in hashes),
                              tuple(n for _, n in hashes)))
    fields = dict(zip(("image", "python", "platform"), header.groups(), strict=True))
    return fields, entries


def read_lock(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(header fields, {normalized name: version}) of a lock file."""
    fields, entries = parse_lock(path)
    return fields, {entry.name: entry.version for entry in entries if entry.version}


def lock_problems(path: Path, entries: list[Locked]) -> list[str]:
    """What makes a lock unusable, checked without the network: each requirement parses, is pinned with ==, has
    a well-formed hash (sha256:<64 hex digits>), and no hash stands for two different files."""
    where = _lock_name(path)
    problems, owner = [], {}
    for entry in entries:
        at = f"{where} line {entry.line}"
        if entry.requirement is None:
            problems.append(f"{at}: not a requirement: {entry.text!r}; fix: make lock")
            continue
        if entry.version is None:
            problems.append(f"{at}: {entry.name}: not pinned with == (found {str(entry.requirement.specifier)!r}); "
                            "fix: make lock")
            continue
        pin = f"{entry.name}=={entry.version}"
        if not entry.hashes:
            problems.append(f"{at}: {pin} has no --hash (pip --require-hashes refuses it); fix: make lock")
        for digest, line in zip(entry.hashes, entry.hash_lines, strict=True):
            at = f"{where} line {line}"
            if not _HASH_RE.match(digest):
                problems.append(f"{at}: {pin}: --hash={digest}: expected sha256:<64 hex digits>; fix: make lock")
            elif owner.setdefault(digest, (pin, line))[0] != pin:
                problems.append(f"{at}: {pin}: --hash={digest} is also listed for {owner[digest][0]} (line "
                                f"{owner[digest][1]}); one file cannot be both; fix: make lock")
    return problems


def _hash_problem(path: Path, entry: Locked, indexes: tuple[str, ...], online: bool) -> str | None:
    """A line naming the hashes of `entry` that no index publishes for its version (online), or that an earlier
    answer of an index cached on disk contradicts (offline). Cache hits never fail a check on their own: a miss
    online is asked again."""
    wanted = {d.removeprefix("sha256:") for d in entry.hashes}
    published: dict[str, str] = {}
    for index in indexes:
        cached = package_index.cached_hashes(index, entry.name, entry.version)
        if online and (cached is None or not wanted <= set(cached.values())):
            cached = package_index.published_hashes(index, entry.name, entry.version)
        published.update(cached or {})
    if not published:
        if not online:
            return None
        return (f"{_lock_name(path)} line {entry.line}: {entry.name}=={entry.version} is not on "
                f"{', '.join(map(package_index.redact, indexes))} (pip's index); fix: make lock, or point pip at the "
                "index the lock was made from (PIP_INDEX_URL)")
    unknown = [(d, n) for d, n in zip(entry.hashes, entry.hash_lines, strict=True)
               if d.removeprefix("sha256:") not in set(published.values())]
    if not unknown:
        return None
    return (f"{_lock_name(path)} line {unknown[0][1]}: {entry.name}=={entry.version}: --hash={unknown[0][0]}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''} is not the hash of any of its "
            f"{len(published)} files on {', '.join(map(package_index.redact, indexes))}; the lock is corrupted or "
            "stale; fix: make lock")


def check_lock_hashes(path: Path, online: bool = True) -> list[str]:
    """lock_problems, then every hash against the index pip is configured with: asked (online, pages fetched
    in parallel and cached) or as cached from an earlier online check (offline)."""
    _, entries = parse_lock(path)
    problems = lock_problems(path, entries)
    if problems:
        return problems
    indexes = package_index.pip_index_urls()
    with ThreadPoolExecutor(INDEX_THREADS) as pool:
        found = pool.map(lambda entry: _hash_problem(path, entry, indexes, online), entries)
        return [line for line in found if line]


def stack_versions(pins: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{component: (package, version)} for cuda/cudnn/nccl found among `pins`; CUDA as major.minor."""
    found = {}
    for component, pattern in _COMPONENT_PACKAGES.items():
        for package, version in pins.items():
            if version and pattern.match(package):
                found[component] = (package, ".".join(version.split(".")[:2]) if component == "cuda" else version)
                break
    return found


def _stack_disagreements(image: Image, pins: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(component, matrix version, package, found version) for each of cuda/cudnn/nccl that `pins` contradicts."""
    stack = stack_versions(pins)
    found = {c: stack.get(c, (f"no {c} package", "none")) for c in _COMPONENT_PACKAGES}
    return [(c, getattr(image, c), *found[c]) for c in _COMPONENT_PACKAGES if found[c][1] != getattr(image, c)]


def _torch_metadata_pins(image: Image) -> tuple[dict[str, str], Requirement | None]:
    """(exact pins torch's wheel requires, torchvision's requirement on torch)."""
    torch_reqs = wheel_meta.requirements(wheel_meta.wheel_metadata("torch", image.torch, image.python), image.python)
    vision_reqs = wheel_meta.requirements(wheel_meta.wheel_metadata("torchvision", image.torchvision, image.python),
                                          image.python)
    pins = {name: wheel_meta.exact_pin(req) or "" for name, req in torch_reqs.items()}
    return pins, vision_reqs.get("torch")


def check_image(image: Image, with_metadata: bool = True,
                metadata_source: Callable[[Image], tuple[dict[str, str], Requirement | None]] | None = None,
                ) -> list[str]:
    """Every disagreement between the matrix, the image's lock and (optionally) torch's wheel metadata,
    one line each: image, field, expected, found, fix."""
    problems: list[str] = []
    where = f"image {image.name!r}"
    lock_name = f"images/locks/{image.lock_path.name}"
    header, lock = read_lock(image.lock_path)
    if header["python"] != image.python or header["image"] != image.name:
        problems.append(f"{where}: python: {MATRIX_PATH.name} says {image.python}, {lock_name} was made for "
                        f"{header['image']} python {header['python']}; fix: make lock")
    for field in ("torch", "torchvision"):
        if lock.get(field) != getattr(image, field):
            problems.append(f"{where}: {field}: {MATRIX_PATH.name} says {getattr(image, field)}, {lock_name} has "
                            f"{lock.get(field, 'none')}; fix: make lock")
    for component, expected, package, found in _stack_disagreements(image, lock):
        problems.append(f"{where}: {component}: {MATRIX_PATH.name} says {expected}, {lock_name} has "
                        f"{package}=={found}; fix: make lock, or correct {component} in {MATRIX_PATH.name}")
    if image.flavor == "lab":
        problems += _lab_disagreements(image, lock)
    problems += [f"{where}: {line}" for line in check_lock_hashes(image.lock_path, online=with_metadata)]
    if not with_metadata:
        return problems
    torch_pins, vision_on_torch = (metadata_source or _torch_metadata_pins)(image)
    for component, expected, package, found in _stack_disagreements(image, torch_pins):
        problems.append(f"{where}: {component}: {MATRIX_PATH.name} says {expected}, torch {image.torch}'s wheel "
                        f"metadata requires {package}=={found}; fix: set {component} = \"{found}\" in "
                        f"{MATRIX_PATH.name} (or pick the torch built for {expected}), then make lock")
    if vision_on_torch is not None and not SpecifierSet(str(vision_on_torch.specifier)).contains(image.torch):
        problems.append(f"{where}: torchvision: torchvision {image.torchvision} requires {vision_on_torch}, "
                        f"{MATRIX_PATH.name} says torch {image.torch}; fix: pick the torchvision released with it")
    return problems


def _lab_disagreements(image: Image, lock: dict[str, str]) -> list[str]:
    """A lab lock must pin the matrix's JupyterLab and leave every package of the image below it as it is."""
    where = f"image {image.name!r}"
    lock_name = f"images/locks/{image.lock_path.name}"
    problems = []
    if lock.get("jupyterlab") != image.jupyterlab:
        problems.append(f"{where}: jupyterlab: {MATRIX_PATH.name} says {image.jupyterlab}, {lock_name} has "
                        f"{lock.get('jupyterlab', 'none')}; fix: make lock")
    for below in (parent_lock(image), VALIDATION_LOCK):
        _, pins = read_lock(below)
        for name, version in sorted(pins.items()):
            if name in lock and lock[name] != version:
                problems.append(f"{where}: {name}: images/locks/{below.name} has {version}, {lock_name} has "
                                f"{lock[name]} (installing the lab would change the image below it); fix: make lock")
    return problems


def cached_coverage(paths: Iterable[Path]) -> tuple[int, int]:
    """(pins whose hashes an offline check compared, pins in these locks): offline, a pin is compared only with an
    earlier online check's cached answer of the index."""
    indexes = package_index.pip_index_urls()
    compared = total = 0
    for path in dict.fromkeys(paths):
        for entry in parse_lock(path)[1]:
            if entry.version is None:
                continue
            total += 1
            compared += any(package_index.cached_hashes(index, entry.name, entry.version) is not None
                            for index in indexes)
    return compared, total


def offline_summary(matrix: Matrix, names: Iterable[str] = ()) -> str:
    """What an offline check compared, and what it did not."""
    chosen = [matrix.get(name) for name in names] or list(matrix.images)
    compared, total = cached_coverage([*(image.lock_path for image in chosen), VALIDATION_LOCK])
    missing = total - compared
    return (f"offline: matrix vs locks compared; torch's wheel metadata not read; the hashes of {compared} of {total} "
            f"pins compared with cached index data" + (
                f", {missing} not compared (no cached answer of the index: run `make check` online once)"
                if missing else ""))


def check_matrix(matrix: Matrix, with_metadata: bool = True, names: Iterable[str] = ()) -> list[str]:
    """check_image for each image (`names`, default all), then the validation lock every image installs."""
    chosen = [matrix.get(name) for name in names] or list(matrix.images)
    problems = [line for image in chosen for line in check_image(image, with_metadata)]
    return problems + check_lock_hashes(VALIDATION_LOCK, online=with_metadata)
