"""The image matrix (images/matrix.toml): load it, check every field, answer questions about it.

Every other part of stackproof (locks, bake, labels, the runtime pin checks) reads versions from here.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the matrix names Python 3.10 images, and their validation layer runs this (tomli is in pyproject)
    import tomli as tomllib

from stackproof.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
MATRIX_PATH = REPO_ROOT / "images" / "matrix.toml"
LOCKS_DIR = REPO_ROOT / "images" / "locks"
# Images are tagged <namespace>/pytorch:<version tag> and <namespace>/validation:<version tag>.
NAMESPACE = "stackproof"
RUNTIME_REPOSITORY = "pytorch"
TAG_REPOSITORY = f"{NAMESPACE}/{RUNTIME_REPOSITORY}"
# lab: the validation image of a runtime entry (named by 'from') plus JupyterLab; it inherits every other version.
FLAVORS = ("runtime", "devel", "lab")
LAB_FIELDS = ("name", "flavor", "from", "jupyterlab")

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_VERSION = re.compile(r"^\d+(\.\d+)+$")
_MAJOR_MINOR = re.compile(r"^\d+\.\d+$")
# nvidia/cuda:13.0.2-devel-ubuntu24.04 -> CUDA 13.0
_CUDA_BASE = re.compile(r"^nvidia/cuda:(\d+\.\d+)(\.\d+)?-.*devel")


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    flavor: str
    base: str
    python: str
    torch: str
    torchvision: str
    cuda: str
    cudnn: str
    nccl: str
    # lab flavor only: the runtime entry it extends, and its JupyterLab version.
    parent: str = ""
    jupyterlab: str = ""

    @property
    def version_tag(self) -> str:
        """What follows the ':' in every tag of this image, e.g. 2.14.1-cu13.0-runtime."""
        return f"{self.torch}-cu{self.cuda}-{self.flavor}"

    def tag_in(self, namespace: str) -> str:
        return f"{namespace}/{RUNTIME_REPOSITORY}:{self.version_tag}"

    @property
    def tag(self) -> str:
        """The shipped tag, e.g. stackproof/pytorch:2.14.1-cu13.0-runtime."""
        return self.tag_in(NAMESPACE)

    @property
    def lock_path(self) -> Path:
        return LOCKS_DIR / f"{self.name}.txt"

    @property
    def cuda_major(self) -> str:
        return self.cuda.split(".")[0]

    def pins(self) -> dict[str, str]:
        """The versions this image promises, by the names the runtime checks use."""
        return {
            "python": self.python,
            "torch": self.torch,
            "torchvision": self.torchvision,
            "cuda": self.cuda,
            "cudnn": self.cudnn,
            "nccl": self.nccl,
        }


FIELDS = tuple(f.name for f in dataclasses.fields(Image) if f.name not in ("parent", "jupyterlab"))


_APT_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


@dataclasses.dataclass(frozen=True)
class Matrix:
    default: str
    images: tuple[Image, ...]
    # What NCCL's InfiniBand/RoCE transport loads at run time (libibverbs and its providers), installed in every
    # runtime layer from its base's apt repository: the names are pinned here, the versions are the base's.
    rdma_packages: tuple[str, ...] = ()

    def get(self, name: str) -> Image:
        for image in self.images:
            if image.name == name:
                return image
        known = ", ".join(i.name for i in self.images)
        raise ConfigError(f"image {name!r}: not in {MATRIX_PATH.name}; known images: {known}; fix: name one of them "
                          "(stackproof images list)")

    @property
    def default_image(self) -> Image:
        return self.get(self.default)


def _check_lab(raw: dict, where: str, runtimes: dict[str, Image]) -> Image:
    """A lab entry names only what it adds; everything else comes from its 'from' entry (written once)."""
    missing = [f for f in LAB_FIELDS if f not in raw]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r} (a lab image needs: {', '.join(LAB_FIELDS)})")
    extra = sorted(set(raw) - set(LAB_FIELDS))
    if extra:
        raise ConfigError(f"{where}: field {extra[0]!r} is not allowed on a lab image: it inherits it from its "
                          f"'from' image (a lab image has only: {', '.join(LAB_FIELDS)})")
    parent = runtimes.get(raw["from"])
    if parent is None:
        raise ConfigError(f"{where}: field 'from' = {raw['from']!r}, expected the name of a runtime image "
                          f"({', '.join(runtimes) or 'none'})")
    if not isinstance(raw["jupyterlab"], str) or not _VERSION.match(raw["jupyterlab"]):
        raise ConfigError(f"{where}: field 'jupyterlab' = {raw['jupyterlab']!r}, expected a dotted version such "
                          "as 4.5.0")
    if not isinstance(raw["name"], str) or not _NAME.match(raw["name"]):
        raise ConfigError(f"{where}: field 'name' = {raw['name']!r}, expected lowercase letters, digits and '-'")
    return dataclasses.replace(parent, name=raw["name"], flavor="lab", parent=parent.name,
                               jupyterlab=raw["jupyterlab"])


def _check_image(raw: dict, index: int, runtimes: dict[str, Image] | None = None) -> Image:
    label = raw.get("name") or f"#{index + 1}"
    where = f"{MATRIX_PATH.name}: image {label!r}"
    if raw.get("flavor") == "lab":
        return _check_lab(raw, where, runtimes or {})
    missing = [f for f in FIELDS if f not in raw]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r} (every image needs: {', '.join(FIELDS)})")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (known fields: {', '.join(FIELDS)})")
    for field in FIELDS:
        if not isinstance(raw[field], str) or not raw[field]:
            raise ConfigError(f"{where}: field {field!r} must be a non-empty string, found {raw[field]!r}")
    image = Image(**raw)

    def bad(field: str, expected: str) -> ConfigError:
        return ConfigError(f"{where}: field {field!r} = {getattr(image, field)!r}, expected {expected}")

    if not _NAME.match(image.name):
        raise bad("name", "lowercase letters, digits and '-' (it names a bake target and a lock file)")
    if image.flavor not in FLAVORS:
        raise bad("flavor", " or ".join(FLAVORS))
    for field in ("torch", "torchvision", "cudnn", "nccl"):
        if not _VERSION.match(getattr(image, field)):
            raise bad(field, "a dotted version such as 1.2.3")
    for field in ("python", "cuda"):
        if not _MAJOR_MINOR.match(getattr(image, field)):
            raise bad(field, "major.minor such as 3.12")
    if image.flavor == "devel":
        cuda_base = _CUDA_BASE.match(image.base)
        if not cuda_base:
            raise bad("base", "an nvidia/cuda:<cuda>-...devel... image for the devel flavor")
        if cuda_base.group(1) != image.cuda:
            raise bad("base", f"an nvidia/cuda devel image of CUDA {image.cuda} (field 'cuda'), "
                              f"not CUDA {cuda_base.group(1)}")
    return image


def load_matrix(path: Path = MATRIX_PATH) -> Matrix:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (the image matrix; run from a stackproof checkout)") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path.name}: not valid TOML: {err}") from None
    unknown = sorted(set(raw) - {"default", "image", "rdma_packages"})
    if unknown:
        raise ConfigError(f"{path.name}: unknown top-level key {unknown[0]!r} (known: default, image, rdma_packages)")
    rdma = raw.get("rdma_packages", [])
    if not isinstance(rdma, list) or not all(isinstance(n, str) and _APT_NAME.match(n) for n in rdma):
        raise ConfigError(f"{path.name}: field 'rdma_packages' = {rdma!r}, expected a list of apt package names "
                          "(libibverbs1, ibverbs-providers, ...)")
    entries = raw.get("image") or []
    if not entries:
        raise ConfigError(f"{path.name}: no [[image]] entries")
    # Lab entries last: they read the runtime entry they extend.
    plain = {i: _check_image(entry, i) for i, entry in enumerate(entries) if entry.get("flavor") != "lab"}
    runtimes = {image.name: image for image in plain.values() if image.flavor == "runtime"}
    images = tuple(plain[i] if i in plain else _check_image(entry, i, runtimes) for i, entry in enumerate(entries))
    seen: set[str] = set()
    for image in images:
        if image.name in seen:
            raise ConfigError(f"{path.name}: image {image.name!r}: field 'name' is used twice; names must be unique")
        seen.add(image.name)
    tags = [image.tag for image in images]
    for image in images:
        if tags.count(image.tag) > 1:
            raise ConfigError(f"{path.name}: image {image.name!r}: tag {image.tag} is shared with another image; "
                              "change torch, cuda or flavor")
    default = raw.get("default")
    if default not in seen:
        raise ConfigError(f"{path.name}: field 'default' = {default!r}, expected one of: {', '.join(sorted(seen))}")
    return Matrix(default=default, images=images, rdma_packages=tuple(rdma))
