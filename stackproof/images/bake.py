"""Render the image matrix as a docker buildx bake file (JSON) that extends the static docker-bake.hcl.

docker-bake.hcl holds how each layer is built (Dockerfiles, contexts, secrets, common labels); this module
adds only what images/matrix.toml says: one target per image and per layer, their args, tags and links.

    python -m stackproof images bake          # writes build/images.bake.json
    docker buildx bake -f docker-bake.hcl -f build/images.bake.json default
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from stackproof.errors import ConfigError, StackproofError
from stackproof.images import sbom
from stackproof.images.matrix import MATRIX_PATH, NAMESPACE, REPO_ROOT, Image, Matrix, load_matrix

BAKE_HCL = REPO_ROOT / "docker-bake.hcl"
DEFAULT_OUTPUT = REPO_ROOT / "build" / "images.bake.json"
WHEELHOUSE_DIR = REPO_ROOT / "wheelhouse"
VALIDATION_REPOSITORY = "validation"
# A docker repository path: lowercase components joined by '/'.
_NAMESPACE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
GROUPS = ("default", "all")
# Matrix names are [a-z0-9-], so an '_' suffix can never collide with another image's target.
BASE_SUFFIX = "_base"
DEVEL_SUFFIX = "_devel"
VALIDATION_SUFFIX = "_validation"


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise ConfigError(f"NAMESPACE={namespace!r}: not a docker repository path; expected lowercase "
                          f"letters, digits, '.', '_', '-' and '/', e.g. {NAMESPACE} or stackproof-test/run1")
    return namespace


def validation_tag(image: Image, namespace: str = NAMESPACE) -> str:
    """<namespace>/validation:<same tag as the runtime image>, e.g. stackproof/validation:2.14.1-cu13.0-runtime."""
    return f"{check_namespace(namespace)}/{VALIDATION_REPOSITORY}:{image.version_tag}"


def external_validation_tag(base: str, namespace: str = NAMESPACE) -> str:
    """The tag of the validation layer on top of someone else's image: its reference as a legal tag."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip(".-")[:128]
    if not tag:
        raise ConfigError(f"BASE={base!r}: not an image reference; "
                          "expected e.g. pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime")
    return f"{check_namespace(namespace)}/{VALIDATION_REPOSITORY}:{tag}"


def targets_for(image: Image) -> list[str]:
    """The bake targets `make build IMAGE=<name>` builds: the runtime image and its validation layer (a lab image
    is one target: it is already built on its 'from' image's validation layer)."""
    if image.flavor == "lab":
        return [image.name]
    return [image.name, image.name + VALIDATION_SUFFIX]


def wheelhouse_for(image: Image, root: Path = WHEELHOUSE_DIR, layer: str = "runtime") -> Path | None:
    """wheelhouse/<name>/ (runtime) or wheelhouse/<name>/validation/ when it holds wheels (make wheelhouse):
    that layer then installs from it with --no-index."""
    path = root / image.name / ("validation" if layer == "validation" else "")
    return path if any(path.glob("*.whl")) else None


def _relative(path: Path) -> str:
    # buildx resolves local contexts against its working directory: the repository root (see the Makefile).
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path.resolve())


def _lab_targets(image: Image, namespace: str) -> dict[str, dict]:
    return {image.name: {
        "inherits": ["_lab"],
        "contexts": {"validation": f"target:{image.parent}{VALIDATION_SUFFIX}",
                     "sbom": _relative(sbom.context_dir(image))},
        "args": {"IMAGE_NAME": image.name, "JUPYTERLAB": image.jupyterlab},
        "tags": [image.tag_in(check_namespace(namespace))],
    }}


def _image_targets(image: Image, wheelhouse_root: Path, namespace: str,
                   rdma_packages: tuple[str, ...] = ()) -> dict[str, dict]:
    if image.flavor == "lab":
        return _lab_targets(image, namespace)
    base_target = image.name + BASE_SUFFIX
    targets: dict[str, dict] = {
        base_target: {"inherits": ["_base"], "args": {"BASE": image.base, "PYTHON": image.python}},
    }
    below_runtime = base_target
    if image.flavor == "devel":
        below_runtime = image.name + DEVEL_SUFFIX
        targets[below_runtime] = {
            "inherits": ["_devel"],
            "contexts": {"base": f"target:{base_target}"},
            "args": {"CUDA": image.cuda, "CUDA_MAJOR": image.cuda_major, "CUDNN": image.cudnn, "NCCL": image.nccl},
        }
    def wheelhouse(layer: str) -> dict[str, str]:
        path = wheelhouse_for(image, wheelhouse_root, layer)
        return {"wheelhouse": _relative(path)} if path else {}

    targets[image.name] = {
        "inherits": ["_runtime"],
        "contexts": {"base": f"target:{below_runtime}", "sbom": _relative(sbom.context_dir(image)),
                     **wheelhouse("runtime")},
        "args": {
            "IMAGE_NAME": image.name,
            "FLAVOR": image.flavor,
            "BASE": image.base,
            "PYTHON": image.python,
            "TORCH": image.torch,
            "TORCHVISION": image.torchvision,
            "CUDA": image.cuda,
            "CUDNN": image.cudnn,
            "NCCL": image.nccl,
            "RDMA_PACKAGES": " ".join(rdma_packages),
        },
        "tags": [image.tag_in(check_namespace(namespace))],
    }
    targets[image.name + VALIDATION_SUFFIX] = {
        "inherits": ["_validation"],
        "contexts": {"runtime": f"target:{image.name}", "sbom": _relative(sbom.context_dir(image, "validation")),
                     **wheelhouse("validation")},
        "tags": [validation_tag(image, namespace)],
    }
    return targets


def render(matrix: Matrix, wheelhouse_root: Path = WHEELHOUSE_DIR, namespace: str = NAMESPACE) -> dict:
    """The bake file for `matrix`: targets per image (see docker-bake.hcl) and the groups default and all,
    tagged under `namespace` (tests build under their own, so the shipped tags are never touched)."""
    clash = sorted({image.name for image in matrix.images} & set(GROUPS))
    if clash:
        raise ConfigError(f"{MATRIX_PATH.name}: image {clash[0]!r}: field 'name' is a reserved bake group name "
                          f"({', '.join(GROUPS)}); rename the image")
    targets: dict[str, dict] = {}
    for image in matrix.images:
        targets.update(_image_targets(image, wheelhouse_root, namespace, matrix.rdma_packages))
    return {
        "group": {
            "default": {"targets": targets_for(matrix.default_image)},
            "all": {"targets": [t for image in matrix.images for t in targets_for(image)]},
        },
        "target": targets,
    }


def write(matrix: Matrix, output: Path | str | None = None, wheelhouse_root: Path = WHEELHOUSE_DIR,
          namespace: str = NAMESPACE) -> Path:
    """Write render(matrix) as JSON to `output` (default build/images.bake.json); returns the path."""
    output = Path(output) if output else DEFAULT_OUTPUT
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(render(matrix, wheelhouse_root, namespace), indent=2) + "\n")
    return output


# What the Makefile asks about one image (--show FIELD [--image NAME]).
SHOW = {
    "name": lambda image, _: image.name,
    "targets": lambda image, _: " ".join(targets_for(image)),
    "tag": lambda image, namespace: image.tag_in(check_namespace(namespace)),
    "validation-tag": validation_tag,
    "python": lambda image, _: image.python,
    # What `make dev` installs on a host to validate outside a container: the image's torch stack.
    "requirements": lambda image, _: f"torch=={image.torch} torchvision=={image.torchvision}",
}


def lab_for(matrix: Matrix, image: Image) -> Image:
    """The lab image of `image`: itself when it is one, else the lab entry built on it (make lab)."""
    if image.flavor == "lab":
        return image
    for candidate in matrix.images:
        if candidate.flavor == "lab" and candidate.parent == image.name:
            return candidate
    labs = ", ".join(i.name for i in matrix.images if i.flavor == "lab") or "none"
    raise ConfigError(f"image {image.name!r}: no lab image is built on it in {MATRIX_PATH.name} (lab images: {labs}); "
                      f"fix: add a [[image]] with flavor = \"lab\" and from = \"{image.name}\", or pick IMAGE=<lab>")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `stackproof images bake` (for the CLI's subparser)."""
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT,
                        help="where to write the bake file (default: build/images.bake.json); '-' for stdout")
    parser.add_argument("--matrix", type=Path, default=MATRIX_PATH, help="the image matrix (default: %(default)s)")
    parser.add_argument("--show", choices=sorted([*SHOW, "lab-tag"]),
                        help="print this about --image instead of writing the file (lab-tag: its lab image's tag)")
    parser.add_argument("--image", metavar="NAME", help="with --show: a matrix image (default: the matrix default)")
    parser.add_argument("--namespace", default=NAMESPACE,
                        help="tag images <namespace>/pytorch:... and <namespace>/validation:... (default: %(default)s)")
    parser.add_argument("--external-tag", metavar="BASE",
                        help="print the validation tag for an image outside the matrix (make build-validation)")


def run(args: argparse.Namespace) -> int:
    """`stackproof images bake`: render the matrix; raises ConfigError (exit 2) on a bad matrix."""
    if args.external_tag is not None:
        print(external_validation_tag(args.external_tag, args.namespace))
        return 0
    matrix = load_matrix(args.matrix)
    if args.show:
        image = matrix.get(args.image) if args.image else matrix.default_image
        print(lab_for(matrix, image).tag_in(check_namespace(args.namespace)) if args.show == "lab-tag"
              else SHOW[args.show](image, args.namespace))
        return 0
    if str(args.output) == "-":
        json.dump(render(matrix, namespace=args.namespace), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        path = write(matrix, args.output, namespace=args.namespace)
        for image in matrix.images:  # the SBOMs the images bake in: remade only when their locks change
            for layer in ("runtime",) if image.flavor == "lab" else ("runtime", "validation"):
                sbom.ensure(image, layer)
        print(f"wrote {_relative(path)}: {len(matrix.images)} images, default {matrix.default!r}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stackproof images bake", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except StackproofError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
