"""Small stand-in images for the registry tests: an OCI image layout of one tiny layer, made here (no Docker
engine needed) and pushed with skopeo, so each test can own a fresh digest in a fraction of a second."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def layout(root: Path, content: str) -> Path:
    """An OCI image layout at `root` whose one layer holds /stand-in.txt = content (so each content is its own
    digest)."""
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = content.encode()
        info = tarfile.TarInfo("stand-in.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = _blob(root, buffer.getvalue())
    config = _blob(root, json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                                     "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]}}).encode())
    manifest = _blob(root, json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer}]}).encode())
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": OCI_MANIFEST, **manifest, "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))
    return root


def push(root: Path, tag_reference: str) -> str:
    """Push the layout to REPO:TAG (a loopback registry: plain HTTP); the digest the registry holds it under."""
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{root}:latest",
                    f"docker://{tag_reference}"], check=True, capture_output=True, timeout=120)
    return subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}",
                           f"docker://{tag_reference}"], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()
