"""The SBOM each built image carries at /etc/stackproof/sbom.cdx.json lists exactly what pip has installed in it
(the lab image's is checked in test_lab.py)."""

import json
import subprocess

import pytest
from image_support import RUNTIME_TAG, VALIDATION_TAG
from packaging.utils import canonicalize_name

from stackproof.images import sbom


@pytest.mark.docker
@pytest.mark.parametrize("tag", [RUNTIME_TAG, VALIDATION_TAG])
def test_the_baked_sbom_equals_pip_freeze(built, tag):
    proc = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c",
                           f"python3 -m pip freeze --all; echo ---; cat {sbom.IMAGE_PATH}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    freeze, document = proc.stdout.split("---\n", 1)
    installed = {canonicalize_name(line.split("==")[0]): line.split("==")[1].split("+")[0]
                 for line in freeze.splitlines()}
    installed.pop("pip")  # the venv's installer, not in any lock
    parsed = json.loads(document)
    assert parsed["bomFormat"] == "CycloneDX" and parsed["metadata"]["properties"]
    assert sbom.components(parsed) == installed
