"""The package indexes pip is configured with, and what they publish: every file of a project with its sha256,
from the simple API (PEP 691 JSON, or PEP 503 HTML), with bounded timeouts and an on-disk cache.

Which index: pip's own answer (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, pip.conf, else pip's default), so a user
behind a corporate mirror gets it without a flag. No host name is written here.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html.parser
import json
import os
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from functools import cache
from pathlib import Path

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from stackproof import environment
from stackproof.errors import ConfigError

CACHE_DIR = Path(environment.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "stackproof" / "metadata"
TIMEOUT_S = 60
PIP_TIMEOUT_S = 60
_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
# Asked of pip itself: the index options `pip install` would use, after its env vars and config files.
_ASK_PIP = """
import json
from pip._internal.commands import create_command
options, _ = create_command("install").parse_args([])
print(json.dumps([options.index_url, *options.extra_index_urls]))
"""


def redact(url: str) -> str:
    """`url` without credentials, for messages."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password and not parts.username:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{parts.hostname}"
                                                  + (f":{parts.port}" if parts.port else "")))


@cache
def pip_index_urls(python: str = sys.executable) -> tuple[str, ...]:
    """(index-url, *extra-index-urls) as `python -m pip install` would use them."""
    try:
        proc = subprocess.run([python, "-c", _ASK_PIP], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"could not ask pip ({python}) for its index: {err}") from None
    if proc.returncode != 0:
        raise ConfigError(f"could not ask pip ({python}) for its index (exit {proc.returncode}): "
                          f"{proc.stderr.strip().splitlines()[-1:]}; fix: python -m ensurepip, or run with a "
                          "python that has pip")
    return tuple(json.loads(proc.stdout))


@cache
def _ssl_context() -> ssl.SSLContext:
    # Behind a proxy the CA bundle comes from the same variables pip and curl honour; loaded once per process.
    cafile = next((v for v in (b.get() for b in environment.CA_BUNDLES) if v), None)
    return ssl.create_default_context(cafile=cafile if cafile and os.path.exists(cafile) else None)


def _request(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> urllib.request.Request:
    parts = urllib.parse.urlsplit(url)
    headers = dict(headers or {})
    if parts.username or parts.password:  # an index URL with user:token@ (urllib does not send it by itself)
        token = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port
                                                                                else "")))
    return urllib.request.Request(url, headers=headers, method=method)


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET",
        missing_ok: bool = False) -> tuple[bytes, dict[str, str]] | None:
    """(body, headers) of `url` (None for a 404 when missing_ok); a ConfigError naming the URL (without
    credentials) when it cannot be read."""
    try:
        with urllib.request.urlopen(_request(url, headers, method), timeout=TIMEOUT_S,
                                    context=_ssl_context()) as response:
            return response.read(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        if missing_ok and err.code == 404:
            return None
        raise ConfigError(f"could not read {redact(url)}: {err} (the index is pip's: PIP_INDEX_URL or pip.conf)") \
            from None
    except OSError as err:
        raise ConfigError(f"could not read {redact(url)}: {err} (the index is pip's: PIP_INDEX_URL or pip.conf; "
                          "a proxy's CA: SSL_CERT_FILE)") from None


@dataclasses.dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None = None
    yanked: bool = False


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.anchors: list[tuple[dict[str, str | None], str]] = []
        self._open: dict[str, str | None] | None = None
        self._text = ""

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._open, self._text = dict(attrs), ""

    def handle_data(self, data):
        if self._open is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "a" and self._open is not None:
            self.anchors.append((self._open, self._text.strip()))
            self._open = None


def _parse_page(body: bytes, content_type: str, page_url: str) -> list[IndexFile]:
    if "json" in content_type:
        return [IndexFile(f["filename"], urllib.parse.urljoin(page_url, f["url"]), f.get("hashes", {}).get("sha256"),
                          f.get("size"), bool(f.get("yanked"))) for f in json.loads(body)["files"]]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    files = []
    for attrs, text in parser.anchors:
        href = attrs.get("href") or ""
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        algorithm, _, digest = fragment.partition("=")
        filename = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        files.append(IndexFile(filename, url, digest if algorithm == "sha256" else None,
                               yanked="data-yanked" in attrs))
    return files


_pages: dict[tuple[str, str], list[IndexFile] | None] = {}
_pages_lock = threading.Lock()


def project_files(index: str, project: str) -> list[IndexFile] | None:
    """Every file `index` publishes for `project` (None when the index does not have it); once per process."""
    key = (index, canonicalize_name(project))
    with _pages_lock:
        if key in _pages:
            return _pages[key]
    page_url = f"{index.rstrip('/')}/{key[1]}/"
    if page_url.startswith("file:"):  # a directory index on disk, as pip reads it
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(page_url).path)) / "index.html"
        files = _parse_page(path.read_bytes(), "text/html", path.as_uri()) if path.exists() else None
    else:
        answer = get(page_url, {"Accept": _ACCEPT}, missing_ok=True)
        files = _parse_page(answer[0], answer[1].get("content-type", ""), page_url) if answer else None
    with _pages_lock:
        _pages[key] = files
    return files


def name_and_version(filename: str) -> tuple[str, Version] | None:
    """(normalized project name, version) of a wheel or sdist file name; None for anything else."""
    for parse, invalid in ((parse_wheel_filename, InvalidWheelFilename), (parse_sdist_filename, InvalidSdistFilename)):
        try:
            name, version, *_ = parse(filename)
            return str(name), version
        except invalid:
            continue
    return None


def _cache_path(index: str, project: str, version: str) -> Path:
    where = hashlib.sha256(index.encode()).hexdigest()[:16]
    return CACHE_DIR / "index-hashes" / where / f"{canonicalize_name(project)}-{version}.json"


def cached_hashes(index: str, project: str, version: str) -> dict[str, str] | None:
    """{filename: sha256} of project==version from an earlier answer of `index`, if one was cached."""
    path = _cache_path(index, project, version)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def published_hashes(index: str, project: str, version: str) -> dict[str, str] | None:
    """{filename: sha256} of every file of project==version on `index` (None: not there); cached on disk, since
    a published file never changes (new files for the version are picked up: the caller refreshes on a miss)."""
    files = project_files(index, project)
    if files is None:
        return None
    wanted = (canonicalize_name(project), Version(version))
    hashes = {f.filename: f.sha256 for f in files if f.sha256 and name_and_version(f.filename) == wanted}
    if not hashes:
        return None
    path = _cache_path(index, project, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(hashes, indent=0, sort_keys=True))
    tmp.replace(path)
    return hashes
