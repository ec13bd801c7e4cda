"""The shipping plan without Docker or a registry: tag names, registry paths, the lab lock's constraints, the SBOM
input. The real push/sign/verify runs are in test_registry.py, the lab container in test_lab.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from stackproof.errors import ConfigError
from stackproof.images import bake, locks, sbom, ship
from stackproof.images.matrix import REPO_ROOT, load_matrix

MATRIX = load_matrix()
IMAGE = MATRIX.default_image
LAB = bake.lab_for(MATRIX, IMAGE)
REVISION = "0123456789abcdef0123456789abcdef01234567"


def test_push_plan_maps_local_tags_to_the_registry_with_readable_and_immutable_tags():
    runtime, validation = ship.plan(IMAGE, "localhost:5000/team", REVISION)
    assert (runtime.local, validation.local) == (IMAGE.tag, bake.validation_tag(IMAGE))
    readable = IMAGE.tag.split(":", 1)[1]
    assert runtime.tags == (f"localhost:5000/team/pytorch:{readable}",
                            f"localhost:5000/team/pytorch:{readable}-lock.{locks.lock_digest(IMAGE)[:12]}-git.0123456789ab")
    assert validation.repository == "localhost:5000/team/validation"
    # The validation image's content hash covers validation.txt too, so it differs from the runtime's.
    assert locks.lock_digest(IMAGE, "validation") != locks.lock_digest(IMAGE)
    assert all(len(tag.split(":")[-1]) <= 128 for item in (runtime, validation) for tag in item.tags)


def test_a_lab_image_ships_as_one_image():
    (item,) = ship.plan(LAB, "host/ml", REVISION + "-dirty")
    assert item.tags[0] == f"host/ml/pytorch:{LAB.tag.split(':', 1)[1]}"
    assert item.immutable.endswith("-git.0123456789ab-dirty")


@pytest.mark.parametrize(("registry", "revision", "message"), [
    ("https://localhost:5000/x", REVISION, "expected host[:port]/prefix"),
    ("localhost:5000/UPPER", REVISION, "expected host[:port]/prefix"),
    ("localhost:5000/x", "main", "expected a git commit hash"),
])
def test_bad_registry_or_revision_is_named(registry, revision, message):
    with pytest.raises(ConfigError) as err:
        ship.plan(IMAGE, registry, revision)
    assert message in str(err.value)


def test_the_lock_digest_follows_the_lock_content(tmp_path, monkeypatch):
    before = locks.lock_digest(IMAGE)
    copy = tmp_path / IMAGE.lock_path.name
    copy.write_text(IMAGE.lock_path.read_text() + "# an edit\n")
    monkeypatch.setattr(locks, "LOCKS_DIR", tmp_path)
    monkeypatch.setattr(type(IMAGE), "lock_path", property(lambda image: tmp_path / f"{image.name}.txt"))
    assert locks.lock_digest(IMAGE) != before


def test_a_lab_entry_inherits_everything_but_what_it_adds():
    parent = MATRIX.get(LAB.parent)
    assert parent.flavor == "runtime"
    assert LAB.pins() == parent.pins() and LAB.base == parent.base
    assert LAB.tag == f"stackproof/pytorch:{parent.torch}-cu{parent.cuda}-lab"


def test_a_lab_lock_that_would_change_the_image_below_is_named(tmp_path, monkeypatch):
    _, lab_pins = locks.read_lock(LAB.lock_path)
    _, parent_pins = locks.read_lock(locks.parent_lock(LAB))
    shared = sorted(set(lab_pins) & set(parent_pins) - {"torch", "torchvision"})[0]
    text = LAB.lock_path.read_text().replace(f"{shared}=={lab_pins[shared]}", f"{shared}==0.0.1", 1)
    changed = tmp_path / LAB.lock_path.name
    changed.write_text(text)
    monkeypatch.setattr(type(LAB), "lock_path", property(
        lambda image: changed if image.name == LAB.name else locks.LOCKS_DIR / f"{image.name}.txt"))
    problems = locks.check_image(LAB, with_metadata=False)
    assert any(f"{shared}: images/locks/{LAB.parent}.txt has {parent_pins[shared]}" in p and "0.0.1" in p
               for p in problems), problems
    newer = dataclasses.replace(LAB, jupyterlab="9.9.9")
    assert any("jupyterlab: matrix.toml says 9.9.9" in p for p in locks.check_image(newer, with_metadata=False))


def test_the_sbom_input_is_the_lock_with_only_the_markers_that_apply():
    runtime = sbom.requirements(IMAGE)
    validation = sbom.requirements(IMAGE, "validation")
    _, locked = locks.read_lock(IMAGE.lock_path)
    assert len(runtime.splitlines()) == len(locked)
    assert "--hash=sha256:" in runtime
    assert validation.startswith(runtime)
    # validation.txt is universal: colorama (win32 only) and the <3.11 backports do not apply to the image.
    assert "colorama" not in validation and "pytest==" in validation


def test_make_push_without_registry_says_how(tmp_path):
    proc = subprocess.run(["make", "push", f"PYTHON={sys.executable}"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "usage: make push REGISTRY=host[:port]/prefix" in proc.stderr
