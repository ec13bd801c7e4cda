"""Keys and registries, as a person gets them wrong (issue 36 item 7), through the real registry, skopeo and
cosign: a missing key, a file that is not the key asked for, a wrong password, a registry that does not answer
and one that answers without the image. Each is one line with one fix and the documented exit code: bad input 2,
the registry failing 1 (attest); verify-image refuses (1) telling 'no such image' from 'registry unreachable'.

No validation run is needed: the H200 run's record (tests/fixtures/attest) is attested on a stand-in image. A few
cosign and skopeo calls of about 0.4 s each. Without a registry, skopeo and cosign these tests skip, unless
STACKPROOF_REQUIRE_REGISTRY=1 (CI).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import oci_support
import pytest
from image_support import IMAGE
from test_attest import _cli
from test_registry import registry_prefix

from stackproof.errors import Exit
from stackproof.images import attest, ship

pytestmark = [pytest.mark.registry]

PASSWORD = "the right one"
CPU_CLASS = "gpu=none;gpus=0"
NO_DIGEST = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def registry() -> str:
    return registry_prefix("attest-errors")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """A key pair without a password, one with PASSWORD, and a file that is no key."""
    folder = tmp_path_factory.mktemp("cosign")
    for prefix, password in (("open", ""), ("locked", PASSWORD)):
        subprocess.run(["cosign", "generate-key-pair", "--output-key-prefix", prefix], cwd=folder, check=True,
                       env={**os.environ, "COSIGN_PASSWORD": password}, capture_output=True, timeout=60)
    (folder / "notes.txt").write_text("not a key\n")
    return {path.name: path for path in folder.iterdir()}


@pytest.fixture(scope="module")
def image(registry, tmp_path_factory) -> dict[str, str]:
    tag = f"{registry}/standin:errors"
    digest = oci_support.push(oci_support.layout(tmp_path_factory.mktemp("oci"), f"errors {uuid.uuid4()}"), tag)
    return {"tag": tag, "pinned": f"{registry}/standin@{digest}", "repository": f"{registry}/standin"}


@pytest.fixture
def run(tmp_path) -> Path:
    """A finished run's folder of this test's own."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "attest" / "h200x1-fast-report.json", folder / "report.json")
    return folder


@pytest.fixture(scope="module")
def silent_port() -> int:
    """A loopback port nobody listens on (the kernel's pick, closed again): connection refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mute_port(monkeypatch):
    """A loopback port that takes connections (the kernel's backlog) and never answers; skopeo's wait for a
    manifest cut to 2 s (ship.INSPECT_TIMEOUT_S), so the test does not wait a minute."""
    monkeypatch.setattr(ship, "INSPECT_TIMEOUT_S", 2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def _one_line(said: str) -> str:
    lines = said.strip().splitlines()
    assert len(lines) == 1, said
    assert lines[0].count("fix:") == 1, lines[0]
    return lines[0]


@pytest.mark.parametrize("case, key, password, code, words", [
    ("a missing key", "missing.key", "", Exit.USAGE, ["expected a cosign key file", "found no such file"]),
    ("the public key", "open.pub", "", Exit.USAGE,
     ["expected a cosign private key", "unsupported pem type: PUBLIC KEY", "fix: pass --key the private key"]),
    ("a file that is no key", "notes.txt", "", Exit.USAGE, ["expected a cosign private key", "invalid pem block"]),
    ("a wrong password", "locked.key", "not it", Exit.USAGE,
     ["expected the password that opens it (COSIGN_PASSWORD)", "decryption failed"]),
])
def test_attest_refuses_a_key_it_cannot_sign_with_in_one_line(run, image, keys, capsys, case, key, password, code,
                                                               words):
    path = keys.get(key, keys["open.key"].with_name(key))
    exit_code, said = _cli(capsys, "attest", "--reports", str(run), "--image", image["tag"], "--key", str(path),
                           COSIGN_PASSWORD=password)
    line = _one_line(said)
    assert exit_code == code, line
    assert line.startswith(f"stackproof: --key {path}: "), line
    for word in words:
        assert word in line, line
    assert not (run / attest.RECORD_FILE).exists() and not (run / attest.PREDICATE_FILE).exists()


def test_attest_signs_with_the_password_that_opens_the_key(run, image, keys, capsys):
    """The same key and image as above, its password given: attested (the refusals were about the key alone).
    A later attest with a wrong password leaves what the first one signed, and its record, as they were."""
    exit_code, said = _cli(capsys, "attest", "--reports", str(run), "--image", image["tag"], "--key",
                           str(keys["locked.key"]), COSIGN_PASSWORD=PASSWORD)
    assert exit_code == Exit.OK, said
    assert attest.read_record(run)["reference"] == image["pinned"]
    kept = {name: (run / name).read_text() for name in (attest.RECORD_FILE, attest.PREDICATE_FILE)}
    exit_code, said = _cli(capsys, "attest", "--reports", str(run), "--image", image["tag"], "--key",
                           str(keys["locked.key"]), COSIGN_PASSWORD="not it")
    assert exit_code == Exit.USAGE and "expected the password that opens it" in _one_line(said), said
    assert {name: (run / name).read_text() for name in kept} == kept
    assert sorted(p.name for p in run.iterdir()) == sorted(["report.json", *kept])


@pytest.mark.parametrize("case", ["no registry listens", "no such tag", "no such digest"])
def test_attest_tells_an_unreachable_registry_from_an_image_it_does_not_hold(run, image, keys, silent_port, capsys,
                                                                              case):
    reference = {"no registry listens": f"127.0.0.1:{silent_port}/stackproof/standin:errors",
                 "no such tag": f"{image['repository']}:never-pushed",
                 "no such digest": f"{image['repository']}@{NO_DIGEST}"}[case]
    exit_code, said = _cli(capsys, "attest", "--reports", str(run), "--image", reference, "--key",
                           str(keys["open.key"]), COSIGN_PASSWORD="")
    line = _one_line(said)
    if case == "no registry listens":  # the registry failed (exit 1), not the input
        assert exit_code == Exit.FAILED, line
        assert f"expected the registry 127.0.0.1:{silent_port} to answer, found no answer (" in line, line
        assert "connection refused" in line and "manifest unknown" not in line, line
    else:  # bad input (exit 2): the registry answered that it holds no such image
        assert exit_code == Exit.USAGE, line
        assert line.startswith(f"stackproof: --image {reference}: expected an image digest the registry "), line
        assert "found none (the registry: " in line and "manifest unknown" in line, line


@pytest.mark.parametrize("case, key, words", [
    ("the private key", "open.key", ["expected a cosign public key", "ENCRYPTED SIGSTORE PRIVATE KEY"]),
    ("a file that is no key", "notes.txt", ["expected a cosign public key", "PEM decoding failed"]),
    ("a missing key", "missing.pub", ["expected a cosign key file", "found no such file"]),
])
def test_verify_image_refuses_a_key_it_cannot_verify_with_in_one_line(image, keys, capsys, case, key, words):
    path = keys.get(key, keys["open.pub"].with_name(key))
    exit_code, said = _cli(capsys, "verify-image", image["tag"], "--key", str(path), "--node-class", CPU_CLASS)
    line = _one_line(said)
    assert exit_code == Exit.USAGE, line
    assert line.startswith(f"stackproof: --key {path}: "), line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("case, start, words", [
    ("no registry listens", "registry unreachable: expected the registry 127.0.0.1:{port} to answer, found no answer",
     ["connection refused"]),
    ("no such tag", "no such image: the registry {host} holds none", ["manifest unknown"]),
    # cosign alone would find no attestation on it, as on an image that holds none
    ("no such digest", "no such image: the registry {host} holds none", ["manifest unknown"]),
])
def test_verify_image_tells_an_unreachable_registry_from_an_image_it_does_not_hold(image, keys, silent_port,
                                                                                    registry, capsys, case, start,
                                                                                    words):
    reference = {"no registry listens": f"127.0.0.1:{silent_port}/stackproof/standin:errors",
                 "no such tag": f"{image['repository']}:never-pushed",
                 "no such digest": f"{image['repository']}@{NO_DIGEST}"}[case]
    exit_code, said = _cli(capsys, "verify-image", reference, "--key", str(keys["open.pub"]), "--node-class",
                           CPU_CLASS)
    line = _one_line(said)
    assert exit_code == Exit.FAILED, line
    reason = start.format(port=silent_port, host=registry.split("/", 1)[0])
    assert line.startswith(f"stackproof verify-image: refused {reference}: {reason}"), line
    for word in words:
        assert word in line, line


# --- make sign / make verify (stackproof/images/ship.py): the same keys and registries, the same lines -----------

def _ship(capsys, *argv: str) -> tuple[int, str]:
    code = ship.main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("case, key, password, code, words", [
    ("the public key", "open.pub", "", Exit.USAGE, ["expected a cosign private key", "PUBLIC KEY"]),
    ("a wrong password", "locked.key", "not it", Exit.USAGE, ["expected the password that opens it"]),
    ("a missing key", "missing.key", "", Exit.USAGE, ["expected a cosign key file", "found no such file"]),
])
def test_make_sign_refuses_a_key_it_cannot_sign_with_in_one_line(registry, keys, capsys, tmp_path, monkeypatch,
                                                                  case, key, password, code, words):
    """make sign's first step, on a stand-in pushed under the immutable tag make push gives the default image."""
    revision = "1" * 40
    item = ship.plan(IMAGE, registry, revision)[0]
    oci_support.push(oci_support.layout(tmp_path / "oci", f"sign {uuid.uuid4()}"), item.tags[1])
    monkeypatch.setenv("COSIGN_PASSWORD", password)
    path = keys.get(key, keys["open.key"].with_name(key))
    exit_code, said = _ship(capsys, "sign", "--registry", registry, "--revision", revision, "--key", str(path))
    line = _one_line(said)
    assert exit_code == code and line.startswith(f"error: --key {path}: "), line
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("case, code, words", [
    ("the private key", Exit.USAGE, ["error: --key ", "expected a cosign public key", "ENCRYPTED SIGSTORE PRIVATE"]),
    ("no registry listens", Exit.FAILED, ["to answer, found no answer (", "connection refused"]),
    ("no such tag", Exit.FAILED, ["expected an image the registry ", "found none (the registry: ",
                                  "manifest unknown"]),
])
def test_make_verify_says_which_of_key_registry_and_image_is_wrong(image, keys, silent_port, capsys, case, code,
                                                                    words):
    reference, key = {"the private key": (image["tag"], keys["open.key"]),
                      "no registry listens": (f"127.0.0.1:{silent_port}/stackproof/standin:errors", keys["open.pub"]),
                      "no such tag": (f"{image['repository']}:never-pushed", keys["open.pub"])}[case]
    exit_code, said = _ship(capsys, "verify", "--registry", image["repository"].rsplit("/", 1)[0], "--key", str(key),
                            "--reference", reference)
    line = _one_line(said)
    assert exit_code == code, line
    for word in words:
        assert word in line, line


def test_a_registry_that_never_answers_is_unreachable_not_a_missing_image(keys, mute_port, capsys):
    reference = f"127.0.0.1:{mute_port}/stackproof/standin:errors"
    exit_code, said = _cli(capsys, "verify-image", reference, "--key", str(keys["open.pub"]), "--node-class",
                           CPU_CLASS)
    line = _one_line(said)
    assert exit_code == Exit.FAILED, line
    assert line.startswith(f"stackproof verify-image: refused {reference}: registry unreachable: expected the "
                           f"registry 127.0.0.1:{mute_port} to answer, found no answer ("), line
    assert "context deadline exceeded" in line, line
