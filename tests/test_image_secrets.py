"""No layer of a built image holds the build's secrets: the CA bundle handed to pip, an index URL with credentials,
or anything from the build host's home.

The proof builds the validation layer again, without cache, on the built runtime image (make build-validation's
bake target), with canaries: a CA bundle that is the real one plus a unique comment line, an index URL (pip's own
index) carrying unique credentials, and a unique file in the host's home and in the build context's root. Then every
layer of the result (`docker save`) is read: the canaries appear in none, no layer has /run/secrets or pip's cache,
and no file other than the base's own ca-certificates output equals the CA bundle.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import urllib.parse
import uuid
from pathlib import Path

import pytest
from image_support import RUNTIME_TAG

from stackproof.images.matrix import REPO_ROOT

# The one file of the image allowed to equal a CA bundle: the base's own, from its ca-certificates package.
OWN_CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
HOST_CA = Path(os.environ.get("PIP_CA") or "/etc/ssl/certs/ca-certificates.crt")


def _pip_index_url() -> str:
    """The index pip uses here: PIP_INDEX_URL, else pip's configuration, else pip's own default."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    proc = subprocess.run(["python3", "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip()
    from pip._internal.models.index import PyPI  # pip's default index, as pip itself names it

    return PyPI.simple_url


def _with_credentials(url: str, user: str, token: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{token}@{host}"))


class _Chain(io.RawIOBase):
    """The bytes already read, then the rest of the stream."""

    def __init__(self, head: bytes, tail):
        self.head, self.tail = head, tail

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = self.tail.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _overlay_dirs(tag: str) -> list[str] | None:
    """The image's layer directories (top first) when the engine stores layers with overlay2, else None."""
    driver = json.loads(subprocess.check_output(["docker", "image", "inspect", "--format", "{{json .GraphDriver}}",
                                                 tag], text=True, timeout=60) or "null")
    if not driver or driver.get("Name") != "overlay2":
        return None
    data = driver["Data"]
    return [d for d in [data.get("UpperDir", ""), *data.get("LowerDir", "").split(":")] if d]


def _read(size: int, ca_size: int, new: bool) -> bool:
    # Contents worth reading: everything in the canary build's layers, elsewhere files as large as the CA bundle.
    return size == ca_size or (new and size <= 64 << 20)


def _entries(tag: str, old_layers: set[str]):
    """(layer, path in the image, bytes or None) for every file of every layer of `tag`: straight from the overlay2
    layer directories when the engine has them (fast), else streamed from `docker save`."""
    ca_size = HOST_CA.stat().st_size
    dirs = _overlay_dirs(tag)
    if dirs is not None:
        for layer in dirs:
            new = layer not in old_layers
            for root, _, files in os.walk(layer):
                for name in files:
                    path = Path(root, name)
                    if path.is_symlink() or not path.is_file():
                        continue
                    size = path.stat().st_size
                    yield layer, str(path.relative_to(layer)), path.read_bytes() if _read(size, ca_size, new) else None
        return
    proc = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
            for member in outer:
                if not member.isfile():
                    continue
                handle = outer.extractfile(member)
                head = handle.read(262)
                if len(head) < 262 or head[257:262] != b"ustar":
                    continue  # manifest, config, index: not a layer
                with tarfile.open(fileobj=io.BufferedReader(_Chain(head, handle)), mode="r|") as layer:
                    for entry in layer:
                        data = None
                        if entry.isfile() and _read(entry.size, ca_size, True):
                            data = layer.extractfile(entry).read()
                        yield member.name, entry.name.lstrip("./"), data
    finally:
        proc.stdout.close()
        assert proc.wait(timeout=600) == 0, "docker save failed"


@pytest.mark.docker
def test_no_layer_holds_the_ca_bundle_index_credentials_or_host_home_files(built, tmp_path):
    canary = f"stackproof-canary-{uuid.uuid4().hex}"
    ca = tmp_path / "ca.pem"
    ca.write_bytes(HOST_CA.read_bytes() + f"# {canary}\n".encode())
    index = _with_credentials(_pip_index_url(), "canary-user", canary)
    home_file = Path.home() / f".{canary}"
    context_file = REPO_ROOT / f".{canary}"
    tag = f"stackproof-test/secrets:{canary[-12:]}"
    for path in (home_file, context_file):
        path.write_text(f"{canary}\n")
    try:
        proc = subprocess.run(
            ["docker", "buildx", "bake", "--load", "--no-cache", "--progress=plain", "-f", "docker-bake.hcl",
             "validation_external"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200,
            env={**os.environ, "PIP_CA": str(ca), "STACKPROOF_PIP_INDEX_URL": index, "VALIDATION_BASE": RUNTIME_TAG,
                 "VALIDATION_TAG": tag, "VALIDATION_RUN_USER": "1000:1000"})
    finally:
        for path in (home_file, context_file):
            path.unlink()
    assert proc.returncode == 0, proc.stderr[-4000:]
    # pip really read the secret: it went to the index through the URL with the canary credentials (pip masks them).
    assert "canary-user:****@" in proc.stderr, proc.stderr[-3000:]
    try:
        ca_digest = hashlib.sha256(HOST_CA.read_bytes()).hexdigest()
        old_layers = set(_overlay_dirs(RUNTIME_TAG) or [])
        leaks, seen_layers = [], set()
        for layer, name, data in _entries(tag, old_layers):
            seen_layers.add(layer)
            if name.startswith("run/secrets/") or name.startswith("root/.cache/pip/"):
                leaks.append(f"{layer}: {name} (a build mount's content)")
            if canary in name:
                leaks.append(f"{layer}: {name} (a file from the host's home or the build context)")
            if data is not None:
                if canary.encode() in data:
                    leaks.append(f"{layer}: {name} holds the canary (CA bundle, index credentials or a host file)")
                if name != OWN_CA_BUNDLE and hashlib.sha256(data).hexdigest() == ca_digest:
                    leaks.append(f"{layer}: {name} is a copy of the build host's CA bundle {HOST_CA}")
        assert seen_layers - old_layers and len(seen_layers) > 1, f"read only these layers: {seen_layers}"
        assert not leaks, "\n".join(leaks[:20])
    finally:
        subprocess.run(["docker", "rmi", tag], capture_output=True, timeout=120)
