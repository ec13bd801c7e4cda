"""The bake file rendered from the matrix (no Docker needed; `bake --print` is checked when buildx is there)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest

from stackproof.errors import ConfigError
from stackproof.images import bake
from stackproof.images.matrix import REPO_ROOT, Matrix, load_matrix

MATRIX = load_matrix()
# Images with the runtime -> validation layers (a lab image is one target on top of its 'from' validation image).
LAYERED = [image for image in MATRIX.images if image.flavor != "lab"]
LABS = [image for image in MATRIX.images if image.flavor == "lab"]


@pytest.fixture(scope="module")
def rendered() -> dict:
    return bake.render(MATRIX)


def test_one_runtime_target_per_image_tagged_from_the_matrix(rendered):
    targets = rendered["target"]
    for image in LAYERED:
        runtime = targets[image.name]
        assert runtime["inherits"] == ["_runtime"]
        assert runtime["tags"] == [image.tag]
        assert runtime["args"] == {
            "IMAGE_NAME": image.name, "FLAVOR": image.flavor, "BASE": image.base,
            **{key.upper(): value for key, value in image.pins().items()},
            "RDMA_PACKAGES": " ".join(MATRIX.rdma_packages),
        }
        assert "libibverbs1" in runtime["args"]["RDMA_PACKAGES"]


def test_layers_are_linked_by_named_contexts(rendered):
    targets = rendered["target"]
    for image in LAYERED:
        base = targets[f"{image.name}_base"]
        assert base == {"inherits": ["_base"], "args": {"BASE": image.base, "PYTHON": image.python}}
        if image.flavor == "devel":
            devel = targets[f"{image.name}_devel"]
            assert devel["contexts"] == {"base": f"target:{image.name}_base"}
            assert devel["args"] == {"CUDA": image.cuda, "CUDA_MAJOR": image.cuda_major,
                                     "CUDNN": image.cudnn, "NCCL": image.nccl}
            below = f"{image.name}_devel"
        else:
            assert f"{image.name}_devel" not in targets
            below = f"{image.name}_base"
        assert targets[image.name]["contexts"]["base"] == f"target:{below}"
        validation = targets[f"{image.name}_validation"]
        assert validation["contexts"]["runtime"] == f"target:{image.name}"
        assert validation["tags"] == [bake.validation_tag(image)]


def test_groups_default_and_all(rendered):
    default = MATRIX.default_image.name
    assert rendered["group"]["default"] == {"targets": [default, f"{default}_validation"]}
    assert rendered["group"]["all"]["targets"] == [t for i in MATRIX.images for t in bake.targets_for(i)]
    assert all(f"{i.name}_validation" in rendered["group"]["all"]["targets"] for i in LAYERED)


def test_a_lab_image_is_built_on_its_runtime_validation_image(rendered):
    assert LABS, "the matrix has no lab image"
    for lab in LABS:
        target = rendered["target"][lab.name]
        assert target["inherits"] == ["_lab"]
        assert target["contexts"]["validation"] == f"target:{lab.parent}_validation"
        assert target["args"] == {"IMAGE_NAME": lab.name, "JUPYTERLAB": lab.jupyterlab}
        assert target["tags"] == [lab.tag] and lab.tag.endswith("-lab")
        assert bake.targets_for(lab) == [lab.name]
        assert f"{lab.name}_base" not in rendered["target"]


def test_validation_tags():
    image = MATRIX.default_image
    assert bake.validation_tag(image) == f"stackproof/validation:{image.tag.split(':', 1)[1]}"
    assert bake.external_validation_tag("registry.example.com/team/pytorch:25.01-py3") == \
        "stackproof/validation:registry.example.com-team-pytorch-25.01-py3"
    with pytest.raises(ConfigError):
        bake.external_validation_tag("///")


def test_wheelhouse_context_only_when_it_holds_wheels(tmp_path):
    image = MATRIX.default_image
    (tmp_path / image.name).mkdir()
    plain = bake.render(MATRIX, wheelhouse_root=tmp_path)["target"]
    assert "wheelhouse" not in plain[image.name]["contexts"]
    (tmp_path / image.name / "torch-0-py3-none-any.whl").write_bytes(b"")
    offline = bake.render(MATRIX, wheelhouse_root=tmp_path)["target"]
    assert offline[image.name]["contexts"]["wheelhouse"] == str(tmp_path / image.name)
    assert "wheelhouse" not in offline[f"{image.name}_validation"]["contexts"]
    (tmp_path / image.name / "validation").mkdir()
    (tmp_path / image.name / "validation" / "pytest-0-py3-none-any.whl").write_bytes(b"")
    offline = bake.render(MATRIX, wheelhouse_root=tmp_path)["target"]
    assert offline[f"{image.name}_validation"]["contexts"]["wheelhouse"] == str(tmp_path / image.name / "validation")


def test_group_names_are_reserved():
    clash = Matrix(default="all", images=(dataclasses.replace(MATRIX.default_image, name="all"),))
    with pytest.raises(ConfigError, match="reserved"):
        bake.render(clash)


def test_main_writes_the_file_and_exits_2_on_a_bad_matrix(tmp_path, capsys):
    out = tmp_path / "images.bake.json"
    assert bake.main(["--output", str(out)]) == 0
    assert json.loads(out.read_text()) == bake.render(MATRIX)
    bad = tmp_path / "matrix.toml"
    bad.write_text((REPO_ROOT / "images" / "matrix.toml").read_text().replace('flavor = "runtime"', 'flavor = "x"', 1))
    assert bake.main(["--matrix", str(bad), "--output", str(out)]) == 2
    assert "flavor" in capsys.readouterr().err
    assert bake.main(["--show", "targets"]) == 0
    assert capsys.readouterr().out.split() == bake.targets_for(MATRIX.default_image)


def _buildx() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _buildx(), reason="docker buildx not installed (scripts/ci/docker-engine.sh installs it)")
def test_bake_print_accepts_it(tmp_path):
    out = bake.write(MATRIX, tmp_path / "images.bake.json")
    proc = subprocess.run(["docker", "buildx", "bake", "-f", "docker-bake.hcl", "-f", str(out), "--print", "all"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["target"]
    for lab in LABS:
        assert plan[lab.name]["dockerfile"] == "docker/lab/Dockerfile"
        assert plan[lab.name]["contexts"]["validation"] == f"target:{lab.parent}_validation"
    for image in LAYERED:
        runtime = plan[image.name]
        assert runtime["dockerfile"] == "docker/runtime/Dockerfile"
        assert runtime["tags"] == [image.tag]
        assert runtime["args"]["TORCH"] == image.torch
        assert runtime["labels"]["org.opencontainers.image.licenses"] == "Apache-2.0"
        validation = plan[f"{image.name}_validation"]
        assert validation["dockerfile"] == "docker/validation/Dockerfile"
        assert validation["contexts"]["runtime"] == f"target:{image.name}"
