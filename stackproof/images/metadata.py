"""Read a wheel's own METADATA straight from the package index without downloading the wheel.

torch wheels are ~1 GB; the zip central directory sits at the end, so three HTTP range reads fetch
the few KB we need (pip's and uv's "lazy wheel" trick): indexes serve no PEP 658 metadata for torch.
"""

from __future__ import annotations

import io
import urllib.parse
import urllib.request
import zipfile

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from stackproof.errors import ConfigError
from stackproof.images import index as package_index
from stackproof.images.index import CACHE_DIR

# The images' CPU and libc floor: torch's own Linux wheels are manylinux_2_28 x86_64.
ARCH = "x86_64"
GLIBC_MINOR = 28
_READ_AHEAD = 256 * 1024


def platform_tags() -> list[str]:
    """The wheel platforms an image can install, newest first (manylinux_2_28 down, with the legacy aliases)."""
    aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(GLIBC_MINOR, 4, -1):
        tags.append(f"manylinux_2_{minor}_{ARCH}")
        if minor in aliases:
            tags.append(f"{aliases[minor]}_{ARCH}")
    return tags


def supported_tags(python: str) -> set[Tag]:
    """Every wheel tag CPython `python` (e.g. '3.13') installs on the images' platform."""
    version = tuple(int(part) for part in python.split("."))
    interpreter = "cp" + "".join(map(str, version))
    return {*cpython_tags(version, abis=[interpreter], platforms=platform_tags()),
            *compatible_tags(version, interpreter, platforms=platform_tags())}


def marker_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of the images: CPython `python` on Linux x86_64, no extra requested."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "implementation_version": f"{python}.0", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": ARCH,
            "platform_release": "", "platform_version": "", "extra": ""}


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    return package_index.get(url, headers)[0]


class _HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP range requests, with a small read-ahead buffer."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0
        self._buf_start, self._buf = 0, b""

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        if not (self._buf_start <= self.pos and end <= self._buf_start + len(self._buf)):
            fetch_end = min(self.size, max(end, self.pos + _READ_AHEAD))
            self._buf_start = self.pos
            self._buf = _get(self.url, {"Range": f"bytes={self.pos}-{fetch_end - 1}"})
        data = self._buf[self.pos - self._buf_start : end - self._buf_start]
        self.pos += len(data)
        return data


def _wheel_file(package: str, version: str, python: str) -> package_index.IndexFile:
    """The index entry of package==version's wheel for CPython `python` on the images' platform, from the first of
    pip's indexes that has one."""
    supported = supported_tags(python)
    indexes = package_index.pip_index_urls()
    for index in indexes:
        for entry in package_index.project_files(index, package) or []:
            try:
                name, found, _, tags = parse_wheel_filename(entry.filename)
            except InvalidWheelFilename:
                continue
            if (name == canonicalize_name(package) and found == Version(version) and not entry.yanked
                    and tags & supported):
                return entry
    where = ", ".join(package_index.redact(i) for i in indexes)
    raise ConfigError(f"{package}=={version}: no wheel for CPython {python} on {ARCH} Linux on {where} "
                      f"(is the version right? is {package} {version} built for Python {python}?)")


def _open_wheel(entry: package_index.IndexFile) -> zipfile.ZipFile:
    if entry.url.startswith("file:"):
        return zipfile.ZipFile(urllib.request.url2pathname(urllib.parse.urlsplit(entry.url).path))
    size = entry.size
    if size is None:  # PEP 503 pages give no size
        size = int(package_index.get(entry.url, method="HEAD")[1]["content-length"])
    return zipfile.ZipFile(_HttpRangeFile(entry.url, size))


def wheel_metadata(package: str, version: str, python: str) -> str:
    """The METADATA text of package==version's Linux x86_64 wheel for CPython `python` (cached on disk)."""
    cached = CACHE_DIR / f"{package}-{version}-cp{python.replace('.', '')}.METADATA"
    if cached.exists():
        return cached.read_text()
    with _open_wheel(_wheel_file(package, version, python)) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(name).decode()
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(text)
    return text


def requirements(metadata: str, python: str) -> dict[str, Requirement]:
    """Every `Requires-Dist` of a METADATA text that applies in the image (CPython `python`, Linux x86_64, no
    extras), by normalized name."""
    environment = marker_environment(python)
    found: dict[str, Requirement] = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        found[canonicalize_name(requirement.name)] = requirement
    return found


def exact_pin(requirement: Requirement) -> str | None:
    """'2.30.7' for `nvidia-nccl-cu13==2.30.7`; None when the requirement is a range."""
    specs = list(requirement.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
