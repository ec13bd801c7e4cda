"""Shipping through a real registry (scripts/ci/registry.sh starts Debian's docker-registry on 127.0.0.1:5000):
make push, pull by digest, run the pulled validation image on CPU, make sign / make verify with cosign (a fresh
key pair, no transparency log), the SBOM attestation, and a tampered tag that verify must reject.

Needs a Docker engine, the built default image, a registry at $STACKPROOF_TEST_REGISTRY (default
127.0.0.1:5000), skopeo and cosign. Without them these tests skip, unless STACKPROOF_REQUIRE_REGISTRY=1 (CI).
Everything is pushed under a fresh prefix (stackproof-test-<random>/...), so runs never see each other's tags.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
import uuid

import pytest
from image_support import IMAGE, RUNTIME_TAG, VALIDATION_TAG, make

from stackproof.images import sbom, ship
from stackproof.images.locks import lock_digest, read_lock
from stackproof.images.matrix import REPO_ROOT

pytestmark = [pytest.mark.registry, pytest.mark.docker]

# Output of `make push`, one line per image: "pushed REPO@sha256:... tags: REPO:a, REPO:b (...)".
_PUSHED = re.compile(r"^pushed (\S+)@(sha256:[0-9a-f]{64})  tags: (\S+), (\S+)  "
                     r"\(([\d.]+) GB compressed, ([\d.]+) s\)$")
# What the pulled copy runs on CPU: two gloo ranks, the collectives, small sizes.
CPU_VALIDATE = ["validate", "--nproc", "2", "-k", "collectives", "--max-check-bytes", "64K", "--sweep-max", "256K"]


def _registry_problem(address: str) -> str | None:
    missing = [tool for tool in ("skopeo", "cosign") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not on PATH"
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=5) as response:
            if response.status != 200:
                return f"http://{address}/v2/ answered {response.status}"
    except OSError as err:
        return f"no registry answers on http://{address}/v2/ ({err})"
    return None


def registry_prefix(name: str) -> str:
    """The running registry + a prefix of this test session's own, or a skip (a failure under
    STACKPROOF_REQUIRE_REGISTRY=1) naming what is missing."""
    address = os.environ.get("STACKPROOF_TEST_REGISTRY", "127.0.0.1:5000")
    problem = _registry_problem(address)
    if problem:
        message = f"needs a registry, skopeo and cosign ({problem}); scripts/ci/registry.sh sets them up"
        if os.environ.get("STACKPROOF_REQUIRE_REGISTRY") == "1":
            pytest.fail(f"STACKPROOF_REQUIRE_REGISTRY=1 but {message}")
        pytest.skip(message)
    return f"{address}/stackproof-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def registry(docker_engine) -> str:
    """REGISTRY for make push."""
    return registry_prefix("test")


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, str]:
    """A fresh cosign key pair (empty password), as make's COSIGN_KEY / COSIGN_PUB."""
    folder = tmp_path_factory.mktemp("cosign")
    subprocess.run(["cosign", "generate-key-pair"], cwd=folder, env={**os.environ, "COSIGN_PASSWORD": ""},
                   check=True, capture_output=True, timeout=60)
    return {"COSIGN_KEY": str(folder / "cosign.key"), "COSIGN_PUB": str(folder / "cosign.pub"),
            "COSIGN_PASSWORD": ""}


def _say(config: pytest.Config, line: str) -> None:
    """Straight to the terminal, for CI's log: push and pull times, compressed size."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(line, flush=True)


def _make(*args: str, **env: str) -> subprocess.CompletedProcess:
    return make(*args, timeout=ship.PUSH_TIMEOUT_S, **env)


@pytest.fixture(scope="session")
def pushed(built, registry, pytestconfig) -> dict[str, dict]:
    """`make push` of the default image: {local tag: {reference, repository, digest, tags, gb, seconds}}."""
    proc = _make("push", f"REGISTRY={registry}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        match = _PUSHED.match(line)
        if match:
            repository, digest, readable, immutable, gb, seconds = match.groups()
            local = RUNTIME_TAG if repository.endswith("/pytorch") else VALIDATION_TAG
            found[local] = {"repository": repository, "digest": digest, "reference": f"{repository}@{digest}",
                            "tags": [readable, immutable], "gb": float(gb), "seconds": float(seconds)}
            _say(pytestconfig, f"\n# {line}")
    assert set(found) == {RUNTIME_TAG, VALIDATION_TAG}, proc.stdout
    return found


@pytest.fixture(scope="session")
def signed(pushed, registry, keys) -> dict[str, str]:
    proc = _make("sign", f"REGISTRY={registry}", **keys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return keys


def test_push_prints_the_digest_both_tags_name(pushed, registry):
    for local, item in pushed.items():
        readable, immutable = item["tags"]
        assert readable == f"{registry}/{local.rsplit('/', 1)[1]}"  # the local repository's last component
        for tag in (readable, immutable):
            assert ship.digest_of(tag) == item["digest"], tag
        assert item["gb"] > 0


def test_the_immutable_tag_names_the_lock_content_and_the_revision(pushed):
    revision = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True).strip()
    runtime_immutable = pushed[RUNTIME_TAG]["tags"][1].rsplit(":", 1)[1]
    readable = RUNTIME_TAG.split(":")[1]
    assert runtime_immutable.startswith(f"{readable}-lock.{lock_digest(IMAGE)[:12]}-git.{revision[:12]}")
    validation_immutable = pushed[VALIDATION_TAG]["tags"][1].rsplit(":", 1)[1]
    assert f"-lock.{lock_digest(IMAGE, 'validation')[:12]}-" in validation_immutable


def test_make_verify_passes_for_the_signed_images_and_their_sboms(signed, pushed, registry):
    proc = _make("verify", f"REGISTRY={registry}", **signed)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for item in pushed.values():
        for tag in item["tags"]:
            assert f"verified {tag} ({item['digest']})" in proc.stdout


def test_the_sbom_attestation_lists_the_locked_packages(signed, pushed):
    """The SBOM attached in the registry is the CycloneDX document of the image's lock, signed with the key."""
    out = subprocess.run(["cosign", "verify-attestation", "--key", signed["COSIGN_PUB"], "--insecure-ignore-tlog=true",
                          "--type", ship.SBOM_PREDICATE, "--output", "json", pushed[RUNTIME_TAG]["reference"]],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    envelope = json.loads(out.splitlines()[0])
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["predicateType"] == "https://cyclonedx.org/bom"
    assert statement["subject"][0]["digest"]["sha256"] == pushed[RUNTIME_TAG]["digest"].split(":", 1)[1]
    document = statement["predicate"]
    _, locked = read_lock(IMAGE.lock_path)
    assert document["bomFormat"] == "CycloneDX"
    assert sbom.components(document) == locked


def test_make_verify_fails_for_a_tampered_tag(signed, pushed, registry):
    """Someone pushes another image under the signed tag: verify must fail and say what to do."""
    readable = pushed[VALIDATION_TAG]["tags"][0]
    build = subprocess.run(["docker", "build", "--quiet", "-t", readable, "-"], text=True, capture_output=True,
                           input=f"FROM {VALIDATION_TAG}\nRUN echo tampered > /tmp/tampered\n", timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    tampered = build.stdout.strip().splitlines()[-1]  # its image ID
    try:
        subprocess.run(["docker", "push", "--quiet", readable], check=True, capture_output=True, timeout=600)
        assert ship.digest_of(readable) != pushed[VALIDATION_TAG]["digest"]
        proc = _make("verify", f"REGISTRY={registry}", **signed)
        assert proc.returncode != 0, proc.stdout
        assert f"verify the signature of {readable}" in proc.stderr, proc.stderr[-3000:]
        assert "tampered or re-pushed" in proc.stderr
        # The digest pinned by make push still verifies: that is what users pin.
        pinned = _make("verify", f"REGISTRY={registry}", f"VERIFY_REFERENCE={pushed[VALIDATION_TAG]['reference']}",
                       **signed)
        assert pinned.returncode == 0, pinned.stderr[-3000:]
    finally:
        subprocess.run(["docker", "tag", VALIDATION_TAG, readable], check=True, capture_output=True, timeout=60)
        subprocess.run(["docker", "push", "--quiet", readable], check=True, capture_output=True, timeout=600)
        subprocess.run(["docker", "image", "rm", tampered], capture_output=True, timeout=120)


def test_an_immutable_tag_is_never_moved_to_another_image(pushed, registry):
    """Another build of the same lock and revision must not take over the immutable tag."""
    other = f"stackproof-test/ship-other:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(["docker", "build", "--quiet", "-t", other, "-"], text=True, capture_output=True,
                           input=f"FROM {VALIDATION_TAG}\nRUN echo another build > /tmp/another\n", timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    revision = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True).strip()
    item = next(i for i in ship.plan(IMAGE, registry, revision) if i.layer == "validation")
    immutable = pushed[VALIDATION_TAG]["tags"][1]
    try:
        if item.tags[1] != immutable:
            pytest.skip(f"this checkout has uncommitted changes: make push tagged {immutable}, not {item.tags[1]}")
        with pytest.raises(ship.ShipError) as err:
            ship.push(dataclasses.replace(item, local=other))
        assert f"the immutable tag {immutable} already names {pushed[VALIDATION_TAG]['digest']}" in str(err.value)
        assert ship.digest_of(immutable) == pushed[VALIDATION_TAG]["digest"]
    finally:
        subprocess.run(["docker", "rmi", other], capture_output=True, timeout=120)


def test_verify_fails_for_an_unsigned_image(pushed, registry, keys):
    """Signed with another key = unsigned for this key."""
    # A key pair that never signed must not verify, whether or not the image was signed with another.
    other = subprocess.run(["cosign", "generate-key-pair", "--output-key-prefix", "other"], cwd=REPO_ROOT / "build",
                           env={**os.environ, "COSIGN_PASSWORD": ""}, capture_output=True, timeout=60)
    assert other.returncode == 0, other.stderr
    try:
        proc = _make("verify", f"REGISTRY={registry}", f"VERIFY_REFERENCE={pushed[RUNTIME_TAG]['reference']}",
                     COSIGN_PUB=str(REPO_ROOT / "build" / "other.pub"))
    finally:
        for name in ("other.key", "other.pub"):
            (REPO_ROOT / "build" / name).unlink(missing_ok=True)
    assert proc.returncode != 0
    assert "no signatures found" in proc.stderr or "no matching signatures" in proc.stderr, proc.stderr[-2000:]


def test_pull_by_digest_and_validate_the_pulled_copy_on_cpu(pushed, signed, tmp_path, pytestconfig):
    """Last: the local copies go, the image comes back by digest, and its validation passes on two CPU ranks."""
    validation = pushed[VALIDATION_TAG]
    # Every blob of the image, downloaded from the registry and checked against its digest by skopeo: what a
    # fresh host transfers (docker pull below may find layers that other local images share).
    started = time.monotonic()
    copy = subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{validation['reference']}",
                           f"oci:{tmp_path / 'oci'}:pulled"], capture_output=True, text=True, timeout=1800)
    assert copy.returncode == 0, copy.stderr[-3000:]
    _say(pytestconfig, f"\n# downloaded every blob of {validation['reference']} ({validation['gb']} GB) in "
                       f"{time.monotonic() - started:.1f} s (skopeo copy, digests checked)")
    shutil.rmtree(tmp_path / "oci")
    for local, item in pushed.items():
        for tag in (local, *item["tags"]):
            subprocess.run(["docker", "rmi", tag], capture_output=True, timeout=120)
    assert subprocess.run(["docker", "image", "inspect", VALIDATION_TAG], capture_output=True).returncode != 0
    started = time.monotonic()
    pull = subprocess.run(["docker", "pull", validation["reference"]], capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - started
    assert pull.returncode == 0, pull.stderr[-3000:]
    _say(pytestconfig, f"\n# pulled {validation['reference']} in {seconds:.1f} s ({pull.stdout.count('Pull complete')} "
                       f"layers downloaded, {pull.stdout.count('Already exists')} already present in another image)")
    try:
        reports = tmp_path / "reports"
        reports.mkdir(mode=0o777)
        reports.chmod(0o777)
        run = subprocess.run(["docker", "run", "--rm", "--ipc=host", "-e", "NVIDIA_VISIBLE_DEVICES=void",
                              "-v", f"{reports}:/reports", validation["reference"], *CPU_VALIDATE],
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "# Verdict: OK" in run.stdout
        report = json.loads((reports / "report.json").read_text())
        assert report["world"]["size"] == 2
        assert any(c["name"].startswith("collectives::") and c["outcome"] == "passed" for c in report["checks"])
    finally:
        # Put the local tags back from the pulled (digest-checked) copies, for whatever runs next.
        for local, item in pushed.items():
            subprocess.run(["docker", "pull", "--quiet", item["reference"]], capture_output=True, timeout=1800)
            subprocess.run(["docker", "tag", item["reference"], local], capture_output=True, timeout=60)
            subprocess.run(["docker", "rmi", item["reference"]], capture_output=True, timeout=120)  # the tag stays
