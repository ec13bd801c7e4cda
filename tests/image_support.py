"""What the real-Docker tests share: the image under test, `make` with the test's python, and the fixtures
(registered in conftest.py) that skip without an engine, or fail when STACKPROOF_REQUIRE_DOCKER=1 (CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from stackproof.images import bake
from stackproof.images.matrix import REPO_ROOT, load_matrix

# STACKPROOF_TEST_IMAGE=<name> runs these against another matrix image.
_MATRIX = load_matrix()
IMAGE = _MATRIX.get(os.environ["STACKPROOF_TEST_IMAGE"]) if os.environ.get("STACKPROOF_TEST_IMAGE") \
    else _MATRIX.default_image
# The tests build and tag under their own namespace (one per run: pytest-xdist's workers share its id, and the
# tests' ids name the tags), never over the shipped stackproof/* tags, and remove what they tagged at the end.
NAMESPACE = f"stackproof-test/{(os.environ.get('PYTEST_XDIST_TESTRUNUID') or uuid.uuid4().hex)[:12]}"
RUNTIME_TAG = IMAGE.tag_in(NAMESPACE)
VALIDATION_TAG = bake.validation_tag(IMAGE, NAMESPACE)
BUILD_TIMEOUT_S = 3600


def _docker_problem() -> str | None:
    if not shutil.which("docker"):
        return "no docker CLI on PATH"
    for cmd in (["docker", "info"], ["docker", "buildx", "version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="session")
def docker_engine() -> None:
    problem = _docker_problem()
    if problem:
        message = f"needs a Docker engine with buildx ({problem}); scripts/ci/docker-engine.sh sets one up"
        if os.environ.get("STACKPROOF_REQUIRE_DOCKER") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_DOCKER=1 but {message}")
        pytest.skip(message)


def make(*args: str, timeout: float = BUILD_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", f"PYTHON={sys.executable}", f"IMAGE={IMAGE.name}", f"NAMESPACE={NAMESPACE}",
                           *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "BUILDKIT_PROGRESS": "plain", **env})


def tagged_by_the_tests() -> list[str]:
    out = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", "--filter",
                          f"reference={NAMESPACE}/*"], capture_output=True, text=True, timeout=60).stdout
    return out.split()


@pytest.fixture(scope="session")
def built(docker_engine) -> None:
    """`make build` of the image under the tests' namespace (cached after the first time); its tags are
    removed at the end of the session."""
    try:
        proc = make("build")
        assert proc.returncode == 0, (
            f"make build failed (is the base {IMAGE.base} there? scripts/ci/base-images.sh):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        yield
    finally:
        tags = tagged_by_the_tests()
        if tags:
            subprocess.run(["docker", "image", "rm", *tags], capture_output=True, timeout=300)


