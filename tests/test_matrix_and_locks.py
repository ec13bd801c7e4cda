"""The matrix is the single source of truth: bad entries and stale locks fail with one line naming the image,
the field, what was expected and what was found (exit 2), before any docker work."""

import dataclasses
import subprocess
import sys

import pytest

from stackproof.errors import ConfigError
from stackproof.images import locks
from stackproof.images.matrix import MATRIX_PATH, load_matrix

GOOD = MATRIX_PATH.read_text()


def write_matrix(tmp_path, text):
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    return path


def test_the_committed_matrix_loads():
    matrix = load_matrix()
    assert matrix.default_image.base == "debian:trixie-slim"
    assert {image.flavor for image in matrix.images} == {"runtime", "devel", "lab"}
    assert len({image.tag for image in matrix.images}) == len(matrix.images)


BAD_ENTRIES = [
    ('flavor = "runtime"\n', 'flavor = "gpu"\n', "field 'flavor' = 'gpu', expected runtime or devel or lab"),
    ('nccl = "2.26.2"\n', "", "image 'legacy': missing field 'nccl'"),
    ('cuda = "12.6"\n', 'cuda = "12.6"\ncudaa = "1"\n', "image 'legacy': unknown field 'cudaa'"),
    ('torch = "2.7.1"\n', 'torch = "latest"\n', "field 'torch' = 'latest', expected a dotted version"),
    ('python = "3.10"\n', 'python = "3"\n', "field 'python' = '3', expected major.minor"),
    ('name = "previous"', 'name = "legacy"', "field 'name' is used twice"),
    ('default = "current"', 'default = "newest"', "field 'default' = 'newest', expected one of"),
    ('base = "nvidia/cuda:13.0.2-devel-ubuntu24.04"', 'base = "nvidia/cuda:12.8.1-devel-ubuntu24.04"',
     "an nvidia/cuda devel image of CUDA 13.0 (field 'cuda'), not CUDA 12.8"),
    ('from = "current"\n', 'from = "current-devel"\n',
     "field 'from' = 'current-devel', expected the name of a runtime image"),
    ('from = "current"\n', 'from = "current"\ntorch = "2.14.1"\n',
     "field 'torch' is not allowed on a lab image: it inherits it from its 'from' image"),
]


@pytest.mark.parametrize(("old", "new", "message"), BAD_ENTRIES, ids=[m[:30] for _, _, m in BAD_ENTRIES])
def test_a_bad_matrix_entry_names_image_and_field(tmp_path, old, new, message):
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        load_matrix(write_matrix(tmp_path, GOOD.replace(old, new, 1)))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_committed_locks_agree_with_the_matrix():
    assert locks.check_matrix(load_matrix(), with_metadata=False) == []


def test_a_stale_lock_is_named_with_expected_and_found():
    current = load_matrix().get("current")
    newer = dataclasses.replace(current, torch="2.14.2", nccl="2.30.8")
    problems = locks.check_image(newer, with_metadata=False)
    assert "image 'current': torch: matrix.toml says 2.14.2, images/locks/current.txt has 2.14.1; fix: make lock" \
        in problems
    assert any(p.startswith("image 'current': nccl: matrix.toml says 2.30.8") and "nvidia-nccl-cu13==2.30.7" in p
               for p in problems)


def test_torch_metadata_disagreeing_with_the_matrix_is_named():
    current = load_matrix().get("current")

    def metadata(_image):  # what torch 2.14.1 would require if it had been built for another NCCL
        return {"cuda-toolkit": "13.0.3", "nvidia-cudnn-cu13": "9.24.0.43", "nvidia-nccl-cu13": "2.31.0"}, None

    problems = locks.check_image(current, metadata_source=metadata)
    assert problems == ["image 'current': nccl: matrix.toml says 2.30.7, torch 2.14.1's wheel metadata requires "
                        "nvidia-nccl-cu13==2.31.0; fix: set nccl = \"2.31.0\" in matrix.toml (or pick the torch "
                        "built for 2.30.7), then make lock"]


@pytest.mark.network
def test_matrix_agrees_with_torch_wheel_metadata_on_pypi():
    """Reads each torch and torchvision wheel's METADATA from PyPI (range requests, no full download)."""
    proc = subprocess.run([sys.executable, "-m", "stackproof", "images", "check"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "agree with their locks and torch's wheel metadata" in proc.stdout


def test_images_check_exits_2_on_a_stale_lock(tmp_path, monkeypatch):
    bad = tmp_path / "legacy.txt"
    bad.write_text(locks.LOCKS_DIR.joinpath("legacy.txt").read_text().replace("torch==2.7.1", "torch==2.7.0"))
    monkeypatch.setattr(locks, "LOCKS_DIR", tmp_path)
    from stackproof import cli
    from stackproof.images import matrix

    monkeypatch.setattr(matrix, "LOCKS_DIR", tmp_path)
    assert cli.main(["images", "check", "--offline", "legacy"]) == 2
