"""Read a wheel's own METADATA straight from PyPI without downloading the wheel.

torch wheels are ~1 GB; the zip central directory sits at the end, so three HTTP range reads fetch
the few KB we need (pip's and uv's "lazy wheel" trick). PyPI serves no PEP 658 metadata for torch.
"""

from __future__ import annotations

import io
import json
import os
import re
import ssl
import urllib.request
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stackproof.errors import ConfigError

SIMPLE_INDEX = os.environ.get("STACKPROOF_SIMPLE_INDEX", "https://pypi.org/simple")
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stackproof" / "metadata"
TIMEOUT_S = 60
_READ_AHEAD = 256 * 1024


def _ssl_context() -> ssl.SSLContext:
    # Behind a proxy the CA bundle comes from the same variables pip and curl honour.
    cafile = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    return ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=_ssl_context()) as response:
            return response.read()
    except OSError as err:
        raise ConfigError(f"could not read {url}: {err} (set STACKPROOF_SIMPLE_INDEX for a mirror, "
                          "SSL_CERT_FILE for a proxy CA)") from None


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


def _wheel_file(package: str, version: str, python: str) -> dict:
    """The simple-API entry of the Linux x86_64 wheel of package==version for CPython `python`."""
    index = json.loads(_get(f"{SIMPLE_INDEX}/{package}/", {"Accept": "application/vnd.pypi.simple.v1+json"}))
    tag = "cp" + python.replace(".", "")
    name = f"{re.escape(package)}-{re.escape(version)}"
    pattern = re.compile(rf"^{name}-(?:{tag}-{tag}|py3-none)-manylinux.*x86_64\.whl$")
    for entry in index["files"]:
        if pattern.match(entry["filename"]) and not entry.get("yanked"):
            return entry
    raise ConfigError(f"{package}=={version}: no Linux x86_64 wheel for Python {python} on {SIMPLE_INDEX} "
                      f"(is the version right? is {package} {version} built for Python {python}?)")


def wheel_metadata(package: str, version: str, python: str) -> str:
    """The METADATA text of package==version's Linux x86_64 wheel for CPython `python` (cached on disk)."""
    cached = CACHE_DIR / f"{package}-{version}-cp{python.replace('.', '')}.METADATA"
    if cached.exists():
        return cached.read_text()
    entry = _wheel_file(package, version, python)
    with zipfile.ZipFile(_HttpRangeFile(entry["url"], entry["size"])) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(name).decode()
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(text)
    return text


def requirements(metadata: str) -> dict[str, Requirement]:
    """Every unconditional-or-Linux `Requires-Dist` of a METADATA text, by normalized name (extras left out)."""
    found: dict[str, Requirement] = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker and "extra" in str(requirement.marker):
            continue
        found[canonicalize_name(requirement.name)] = requirement
    return found


def exact_pin(requirement: Requirement) -> str | None:
    """'2.30.7' for `nvidia-nccl-cu13==2.30.7`; None when the requirement is a range."""
    specs = list(requirement.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None
