"""CycloneDX SBOMs of the images' Python packages, made by cyclonedx-py from the locks the images install.

Every runtime, validation and lab image bakes its own at /etc/stackproof/sbom.cdx.json (named context 'sbom' of
the bake file); `make sign` attaches each pushed image's SBOM to it in the registry as a signed attestation.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from stackproof.errors import ConfigError
from stackproof.images.locks import lock_files
from stackproof.images.matrix import REPO_ROOT, Image

SBOM_DIR = REPO_ROOT / "build" / "sbom"
SBOM_FILE = "sbom.cdx.json"
# Where the images carry it (docker/runtime, docker/validation and docker/lab COPY it there).
IMAGE_PATH = "/etc/stackproof/sbom.cdx.json"
CYCLONEDX_TIMEOUT_S = 300


def context_dir(image: Image, layer: str = "runtime") -> Path:
    return SBOM_DIR / (image.name if layer == "runtime" else f"{image.name}_{layer}")


def _marker_environment(image: Image) -> dict[str, str]:
    # The images are CPython on x86_64 Linux (locks.LOCK_PLATFORM), with the matrix's python.
    return {"python_version": image.python, "python_full_version": f"{image.python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def requirements(image: Image, layer: str = "runtime") -> str:
    """The pinned, hashed requirements installed in `image` (its lock_files), one per line, with the entries whose
    markers do not apply to the image's python and platform left out (the validation lock is universal)."""
    lines: list[str] = []
    seen: set[str] = set()
    for path in lock_files(image, layer):
        entry = ""
        for raw in [*path.read_text().splitlines(), ""]:
            line = raw.strip()
            if line.startswith("#"):
                continue
            entry += " " + line.rstrip("\\").strip()
            if line.endswith("\\"):
                continue
            entry, text = "", entry.strip()
            if not text:
                continue
            spec = text.split(" --hash", 1)[0]
            try:
                requirement = Requirement(spec)
            except InvalidRequirement as err:
                raise ConfigError(f"{path.name}: {spec!r} is not a requirement ({err}); fix: make lock") from None
            if requirement.marker and not requirement.marker.evaluate(_marker_environment(image)):
                continue
            name = canonicalize_name(requirement.name)
            if name not in seen:
                seen.add(name)
                lines.append(text)
    return "\n".join(lines) + "\n"


def _cyclonedx() -> str:
    tool = shutil.which("cyclonedx-py") or str(Path(sys.executable).with_name("cyclonedx-py"))
    if not Path(tool).exists():
        raise ConfigError("cyclonedx-py not found: the SBOMs are made with it; "
                          "fix: pip install cyclonedx-bom (or make dev)")
    return tool


def ensure(image: Image, layer: str = "runtime") -> Path:
    """build/sbom/<name>[_<layer>]/sbom.cdx.json for the image's current locks; remade only when they change."""
    reqs = requirements(image, layer)
    folder = context_dir(image, layer)
    output, stamp = folder / SBOM_FILE, folder / "requirements.sha256"
    digest = hashlib.sha256(reqs.encode()).hexdigest()
    if output.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return output
    folder.mkdir(parents=True, exist_ok=True)
    # --output-reproducible: no timestamp or random serial, so the same locks give the same file (and cache).
    cmd = [_cyclonedx(), "requirements", "--output-reproducible", "--of", "JSON", "-o", str(output), "-"]
    try:
        subprocess.run(cmd, input=reqs, text=True, capture_output=True, check=True, timeout=CYCLONEDX_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        raise ConfigError(f"{output.relative_to(REPO_ROOT)}: cyclonedx-py failed (exit {err.returncode}) on the "
                          f"locks of {image.name!r}: {err.stderr.strip()[-2000:]}") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{output.relative_to(REPO_ROOT)}: cyclonedx-py took over {CYCLONEDX_TIMEOUT_S} s") from None
    stamp.write_text(digest + "\n")
    return output


def components(sbom: dict) -> dict[str, str]:
    """{normalized name: version} of a CycloneDX document's components."""
    return {canonicalize_name(c["name"]): c["version"] for c in sbom.get("components", [])}


def read(path: Path) -> dict:
    return json.loads(path.read_text())
