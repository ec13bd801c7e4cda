# The static half of the image build: how each layer is built. The matrix half (which images, which versions)
# is rendered from images/matrix.toml by `python -m stackproof images bake` into build/images.bake.json, whose
# targets inherit from the ones below. Build through make (make help), or by hand:
#
#   python -m stackproof images bake
#   docker buildx bake -f docker-bake.hcl -f build/images.bake.json [default | all | <name> <name>_validation]
#
# Per image <name> the rendered file has: <name>_base -> [<name>_devel, devel flavor only] -> <name> (runtime,
# tagged Image.tag) -> <name>_validation; a lab image is one target <name> on top of <from>_validation. Layers are linked by named contexts ("target:..."), so each is
# built once and cached separately.

# Set from the environment (the Makefile exports them).
variable "PIP_CA" {
  # A CA bundle file for pip behind a TLS-intercepting proxy; mounted as a secret, never stored in a layer.
  default = ""
}
variable "STACKPROOF_PIP_INDEX_URL" {
  # A private index URL (may carry credentials): only its name is here, bake reads the value as a secret.
  default = ""
}
variable "SOURCE_URL" {
  default = ""
}
variable "REVISION" {
  default = ""
}
variable "CREATED" {
  default = ""
}
# The Dockerfiles carry no `# syntax=` line on purpose: it makes BuildKit fetch docker/dockerfile from Docker Hub
# on every build, which breaks offline and registry-less builds. Everything they use (RUN --mount, COPY --chmod,
# named contexts, <Dockerfile>.dockerignore) is in the frontend built into Docker Engine >= 23. Where a registry
# is reachable, pin the frontend anyway with DOCKERFILE_SYNTAX=docker/dockerfile:1.
variable "DOCKERFILE_SYNTAX" {
  default = ""
}
# make build-validation BASE=<image>: the validation layer on top of any existing PyTorch image.
variable "VALIDATION_BASE" {
  default = ""
}
variable "VALIDATION_TAG" {
  default = ""
}
variable "VALIDATION_RUN_USER" {
  default = "0:0"
}

target "_common" {
  args = DOCKERFILE_SYNTAX != "" ? { BUILDKIT_SYNTAX = DOCKERFILE_SYNTAX } : {}
  secret = concat(
    PIP_CA != "" ? ["type=file,id=pip_ca,src=${PIP_CA}"] : [],
    STACKPROOF_PIP_INDEX_URL != "" ? ["type=env,id=pip_index_url,env=STACKPROOF_PIP_INDEX_URL"] : [],
  )
}

# Labels every image shares (the per-image ones come from build args in the Dockerfiles). Only on the images
# people run: on the intermediate layers a new revision would only churn untagged images.
target "_labels" {
  labels = {
    for key, value in {
      "org.opencontainers.image.licenses" = "Apache-2.0"
      "org.opencontainers.image.source"   = SOURCE_URL
      "org.opencontainers.image.revision" = REVISION
      "org.opencontainers.image.created"  = CREATED
      "org.opencontainers.image.vendor"   = "stackproof"
    } : key => value if value != ""
  }
}

# Rendered targets set args BASE, PYTHON.
target "_base" {
  inherits   = ["_common"]
  # An intermediate layer, reached through named contexts: not exported on its own (the docker driver still
  # keeps it as an untagged image, which is what links it to the next layer).
  output     = ["type=cacheonly"]
  context    = "docker/base"
  dockerfile = "Dockerfile"
}

# Rendered targets set args CUDA, CUDA_MAJOR, CUDNN, NCCL and contexts.base.
target "_devel" {
  inherits   = ["_common"]
  # An intermediate layer, reached through named contexts: not exported on its own (the docker driver still
  # keeps it as an untagged image, which is what links it to the next layer).
  output     = ["type=cacheonly"]
  context    = "docker/devel"
  dockerfile = "Dockerfile"
}

# Rendered targets set every matrix field as an arg, contexts.base, tags and, after make wheelhouse,
# contexts.wheelhouse.
target "_runtime" {
  inherits   = ["_common", "_labels"]
  context    = "."
  dockerfile = "docker/runtime/Dockerfile"
}

# Rendered targets set contexts.runtime, tags and maybe contexts.wheelhouse.
target "_validation" {
  inherits   = ["_common", "_labels"]
  context    = "."
  dockerfile = "docker/validation/Dockerfile"
}

# The lab flavor. Rendered targets set contexts.validation (target:<from>_validation, so the lab shares every
# layer of that image), contexts.sbom, args IMAGE_NAME and JUPYTERLAB, and tags.
target "_lab" {
  inherits   = ["_common", "_labels"]
  context    = "."
  dockerfile = "docker/lab/Dockerfile"
}

target "validation_external" {
  inherits = ["_validation"]
  contexts = {
    runtime = "docker-image://${VALIDATION_BASE}"
  }
  args = {
    RUN_USER = VALIDATION_RUN_USER
  }
  tags = VALIDATION_TAG != "" ? [VALIDATION_TAG] : []
}
