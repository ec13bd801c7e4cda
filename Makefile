# stackproof: build the pinned PyTorch images from images/matrix.toml and prove them on GPUs.
# `make help` lists the commands. Every version comes from images/matrix.toml; nothing is pinned here.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# The project's venv: targets that run PYTHON make it first (make dev) unless PYTHON names another python.
VENV := .venv
PYTHON ?= $(VENV)/bin/python
VENV_READY := $(VENV)/.stackproof-dev
NEED_VENV := $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV_READY))
DOCKER ?= docker
# Bootstraps .venv (make dev): any python3 >= 3.10.
HOST_PYTHON ?= python3
HADOLINT ?= $(if $(NEED_VENV)$(wildcard $(VENV)/bin/hadolint),$(VENV)/bin/hadolint,hadolint)
# A matrix image name; empty means the matrix default.
IMAGE ?=
# make build-validation BASE=<any image with python3 + torch>
BASE ?=
# How test-gpu exposes GPUs: e.g. GPU_FLAGS='--device nvidia.com/gpu=all' (CDI) or '--gpus "device=0,1"'.
GPU_FLAGS ?= --gpus all
# The rest of test-gpu's docker run flags: NCCL wants shared memory, and on GPUs pinned memory without limits.
RUN_FLAGS ?= --ipc=host $(if $(strip $(GPU_FLAGS)),--ulimit memlock=-1)
# Extra arguments for the validation container (e.g. ARGS='validate -k nccl').
ARGS ?=
# The tier test-gpu validates (fast, full, burn); empty: the image's default (full). With TIER, ARGS are validate's
# own flags: make test-gpu TIER=burn ARGS='--burn-seconds 600'.
TIER ?=
REPORTS ?= $(CURDIR)/reports
# What a run's verdict is made of (report.json, junit.xml: the suite's; exit-code: test-gpu's): cleared before each
# run so no earlier verdict stays beside the new one.
VERDICT_FILES := report.json junit.xml exit-code
# Tags are <NAMESPACE>/pytorch:... and <NAMESPACE>/validation:...; empty means stackproof (the tests use their own).
NAMESPACE ?=
# wheelhouse: the platforms the images' wheels may carry; the locks are made for x86_64-manylinux_2_28, and pip
# --platform does not imply the older glibc tags, so they are listed.
WHEEL_PLATFORMS ?= $(foreach v,28 27 26 25 24 23 22 21 20 19 18 17,manylinux_2_$(v)_x86_64) manylinux2014_x86_64
# OFFLINE=1: check skips PyPI (after make wheelhouse, pip installs from wheelhouse/<name>/ with --no-index).
OFFLINE ?=

BAKE_FILE := build/images.bake.json
# --load: the images land in the local engine whichever buildx builder is selected (docker-container too).
BAKE := $(DOCKER) buildx bake --load -f docker-bake.hcl -f $(BAKE_FILE)
IMAGE_OPT := $(if $(IMAGE),--image $(IMAGE))
NAMESPACE_OPT := $(if $(NAMESPACE),--namespace $(NAMESPACE))
# Read by docker-bake.hcl. A proxy's CA bundle goes in as the pip_ca secret when the file exists.
export PIP_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
export REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
export CREATED ?= $(shell git log -1 --format=%cI 2>/dev/null)
export SOURCE_URL ?= $(shell git remote get-url origin 2>/dev/null)

show = $$($(PYTHON) -m stackproof.images.bake --show $(1) $(IMAGE_OPT) $(NAMESPACE_OPT))

# Steps run in the order written: check must fail before any docker work starts.
.NOTPARALLEL:
.PHONY: dev help build build-all build-validation print bake-file lock check wheelhouse lint test validate test-gpu clean
.PHONY: push push-all sign verify verify-image audit lab

help: ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'
	@echo "  variables: IMAGE=<name> BASE=<image> GPU_FLAGS='$(GPU_FLAGS)' TIER=fast|full|burn ARGS='...' PYTHON=$(PYTHON) PIP_CA=$(PIP_CA)"

dev: $(VENV_READY) ## .venv with stackproof (editable, dev tools) and the default image's torch + torchvision

# A file target, so that make test (and every target that runs PYTHON) brings it up on a fresh clone.
$(VENV_READY): pyproject.toml images/matrix.toml
	$(HOST_PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	$(VENV)/bin/python -m pip install -q $$($(VENV)/bin/python -m stackproof.images.bake --show requirements $(IMAGE_OPT))
	touch $@

build: check bake-file ## build the default image (or IMAGE=<name>) and its validation layer
	targets=$(call show,targets); $(BAKE) $$targets

build-all: check bake-file ## build every image of the matrix
	$(BAKE) all

print: bake-file ## show the build plan (docker buildx bake --print) for IMAGE, or the default
	targets=$(call show,targets); $(BAKE) --print $$targets

bake-file: $(NEED_VENV)
	$(PYTHON) -m stackproof images bake --output $(BAKE_FILE) $(NAMESPACE_OPT)

# Bad input (matrix, locks) exits 2 here, before any docker work.
check: $(NEED_VENV) ## matrix vs locks vs torch's wheel metadata (exit 2 on a disagreement; OFFLINE=1 skips PyPI)
	$(PYTHON) -m stackproof images check $(if $(OFFLINE),--offline) $(IMAGE)

lock: $(NEED_VENV) ## regenerate images/locks/ with uv from the matrix
	$(PYTHON) -m stackproof images lock $(IMAGE)

# The image's lock (wheelhouse/<name>/) + the validation lock (wheelhouse/<name>/validation/), for the image's
# python and platform; make build then installs from them with --no-index.
wheelhouse: check ## download the wheels of IMAGE (or the default) to wheelhouse/<name>/ for offline builds
	name=$(call show,name); py=$(call show,python); \
	for pair in "images/locks/$$name.txt wheelhouse/$$name" "images/locks/validation.txt wheelhouse/$$name/validation"; do \
	    set -- $$pair; \
	    $(PYTHON) -m pip download --require-hashes --no-deps --only-binary=:all: \
	        --python-version "$$py" --implementation cp $(addprefix --platform ,$(WHEEL_PLATFORMS)) \
	        --dest "$$2" -r "$$1"; \
	done; \
	echo "wheelhouse/$$name: $$(find wheelhouse/$$name -name '*.whl' | wc -l) wheels, $$(du -sh wheelhouse/$$name | cut -f1)"

lint: $(NEED_VENV) ## ruff + hadolint (+ shellcheck when installed)
	$(PYTHON) -m ruff check .
	$(HADOLINT) docker/*/Dockerfile scripts/ci/*/Dockerfile
	if command -v shellcheck >/dev/null; then shellcheck .ci/run scripts/*/*.sh scripts/slurm/*.sbatch tests/fault_plugins/*.sh docker/*.sh docker/*/*.sh; \
	else echo "lint: shellcheck not installed, shell scripts not checked"; fi

# The suite on this many pytest-xdist workers (tests/conftest.py keeps the tests that share Slurm, Docker or the
# network namespaces on one); 0: one process.
TEST_WORKERS ?= 2
test: $(NEED_VENV) ## the test suite (python -m pytest on TEST_WORKERS workers; makes .venv first)
	$(PYTHON) -m pytest --numprocesses=$(TEST_WORKERS)

validate: $(NEED_VENV) ## run the validation suite on this host's python and GPUs
	$(PYTHON) -m stackproof validate $(ARGS)

accept: $(NEED_VENV) ## on a GPU host: the acceptance run (healthcheck x3, every tier, two emulated nodes); OUT=acceptance
	STACKPROOF_PYTHON=$(PYTHON) scripts/gpu-acceptance.sh $(or $(OUT),acceptance)

# make exits 2 whenever the container fails; the container's own exit code is printed and kept in reports/.
# ATTEST=1: then sign the run's result (PASSED or FAILED) onto the image digest (stackproof attest, COSIGN_KEY):
# the image's RepoDigest (pushed or pulled), or ATTEST_IMAGE=REPO@sha256:... for one built here.
test-gpu: $(NEED_VENV) ## run the validation image of IMAGE (or the default) on the GPUs; reports in ./reports; ATTEST=1 attests
	$(PYTHON) -m stackproof.images.gpu_runtime "$(GPU_FLAGS)"
	@# The image runs as uid 1000: it must be able to replace every file of earlier runs (yours, e.g. root's, or its own).
	mkdir -p $(REPORTS) && cd $(REPORTS) && rm -f $(VERDICT_FILES)
	chmod -R a+rwX $(REPORTS) || { echo "test-gpu: $(REPORTS) holds files this user cannot hand to the container's uid \
	    1000 (above); fix: chown -R $$(id -u) $(REPORTS) as their owner, or REPORTS=<another directory>" >&2; exit 2; }
	tag=$(call show,validation-tag); \
	ref=$$($(DOCKER) image inspect --format '{{range .RepoDigests}}{{.}} {{end}}' "$$tag" 2>/dev/null | cut -d' ' -f1); \
	rc=0; $(DOCKER) run --rm $(GPU_FLAGS) $(RUN_FLAGS) $${ref:+-e STACKPROOF_IMAGE_REF=$$ref} \
	    -v "$(REPORTS):/reports" "$$tag" $(if $(TIER),validate --tier $(TIER)) $(ARGS) || rc=$$?; \
	echo "$$rc" > $(REPORTS)/exit-code; echo "test-gpu: $$tag exited with $$rc"; \
	if [ -n "$(ATTEST)" ] && [ -f $(REPORTS)/report.json ]; then \
	    $(PYTHON) -m stackproof attest --reports $(REPORTS) --key "$(COSIGN_KEY)" \
	        $(if $(ATTEST_IMAGE),--image "$(ATTEST_IMAGE)") || exit $$?; \
	fi; \
	if [ "$$rc" = 125 ] && [[ "$(RUN_FLAGS)" == *memlock* ]]; then \
	    echo "test-gpu: docker could not start the container (exit 125, message above). If it is about an rlimit: this" \
	        "engine cannot lift the locked-memory limit (rootless or nested). Without GPUs it is not needed:" \
	        "GPU_FLAGS= RUN_FLAGS=--ipc=host" >&2; \
	fi; \
	exit "$$rc"

build-validation: $(NEED_VENV) ## only the validation layer, on top of BASE=<image> (tag stackproof/validation:<BASE>)
	@test -n "$(BASE)" || { echo "usage: make build-validation BASE=<image with python3 + torch>" >&2; exit 2; }
	tag=$$($(PYTHON) -m stackproof.images.bake --external-tag "$(BASE)" $(NAMESPACE_OPT)); \
	user=$$($(DOCKER) image inspect --format '{{.Config.User}}' "$(BASE)" 2>/dev/null || true); \
	log=$$(mktemp); rc=0; \
	VALIDATION_BASE="$(BASE)" VALIDATION_TAG="$$tag" VALIDATION_RUN_USER="$${user:-0:0}" \
	    $(DOCKER) buildx bake --load -f docker-bake.hcl validation_external 2>&1 | tee "$$log" >&2 || rc=$$?; \
	said=$$(grep -o "error: the base image [^'\"]*" "$$log" | grep -v '\$$(' | tail -n 1 || true); rm -f "$$log"; \
	if [ "$$rc" != 0 ]; then \
	    echo "build-validation: BASE=$(BASE): $${said:-the build failed, as BuildKit says above}; fix: BASE must be" \
	        "an image whose python3 has pip and torch" >&2; \
	    exit "$$rc"; \
	fi; \
	echo "built $$tag (on $(BASE), runs as $${user:-0:0})"

clean: ## remove build/ (the rendered bake file); images and wheelhouse/ stay
	rm -rf build

# --- Shipping: push, sign, verify, audit, and the lab flavor (docs/shipping.md) ---------------------------------
# make push REGISTRY=host[:port]/prefix: stackproof/pytorch:<tag> -> $(REGISTRY)/pytorch:<tag> (+ validation).
REGISTRY ?=
# cosign key pair (cosign generate-key-pair); the private key's password comes from COSIGN_PASSWORD.
COSIGN_KEY ?= cosign.key
COSIGN_PUB ?= cosign.pub
# make test-gpu ATTEST=1 [ATTEST_IMAGE=REPO@sha256:...]; make verify-image VERIFY_IMAGE=REF [NODE_CLASS=...]
# [MAX_AGE=30d] (docs/attest.md).
ATTEST ?=
ATTEST_IMAGE ?=
VERIFY_IMAGE ?=
NODE_CLASS ?=
MAX_AGE ?=
# make audit STRICT=1 fails on any finding (otherwise they are reported only); ALL=1 audits every lock.
ALL ?=
STRICT ?=
# make lab: the host folder mounted as the notebook workspace, and the host port of JupyterLab.
WORKSPACE ?= $(CURDIR)
LAB_PORT ?= 8888
# The immutable tag's git part; a working tree with uncommitted changes is marked -dirty.
SHIP_REVISION = $(shell git rev-parse HEAD)$(if $(shell git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
SHIP = $(PYTHON) -m stackproof.images.ship
need_registry = @test -n "$(REGISTRY)" || { echo "usage: make $@ REGISTRY=host[:port]/prefix (e.g. localhost:5000/stackproof)" >&2; exit 2; }

push: ## push IMAGE's runtime + validation images to REGISTRY=host[:port]/prefix; prints each digest
	$(need_registry)
	$(SHIP) push --registry "$(REGISTRY)" --revision "$(SHIP_REVISION)" $(IMAGE_OPT) $(NAMESPACE_OPT)

push-all: ## push every image of the matrix to REGISTRY
	$(need_registry)
	$(SHIP) push --registry "$(REGISTRY)" --revision "$(SHIP_REVISION)" --all $(NAMESPACE_OPT)

sign: ## cosign-sign IMAGE's pushed images (COSIGN_KEY) and attach their CycloneDX SBOMs; no transparency log
	$(need_registry)
	$(SHIP) sign --registry "$(REGISTRY)" --revision "$(SHIP_REVISION)" --key "$(COSIGN_KEY)" $(IMAGE_OPT) $(NAMESPACE_OPT)

# VERIFY_REFERENCE=REGISTRY/pytorch@sha256:...: verify that reference instead of IMAGE's tags.
VERIFY_REFERENCE ?=

verify: ## cosign-verify IMAGE's tags in REGISTRY (signature + SBOM) with COSIGN_PUB; fails when unsigned/tampered
	$(need_registry)
	$(SHIP) verify --registry "$(REGISTRY)" --revision "$(SHIP_REVISION)" --key "$(COSIGN_PUB)" $(IMAGE_OPT) $(NAMESPACE_OPT) \
	    $(if $(VERIFY_REFERENCE),--reference "$(VERIFY_REFERENCE)")

verify-image: $(NEED_VENV) ## exit 0 only if VERIFY_IMAGE=REF holds a signed PASSED result for this node's class (COSIGN_PUB)
	@test -n "$(VERIFY_IMAGE)" || { echo "usage: make verify-image VERIFY_IMAGE=REPO@sha256:... [NODE_CLASS=...] [MAX_AGE=30d]" >&2; exit 2; }
	$(PYTHON) -m stackproof verify-image "$(VERIFY_IMAGE)" --key "$(COSIGN_PUB)" \
	    $(if $(NODE_CLASS),--node-class "$(NODE_CLASS)") $(if $(MAX_AGE),--max-age "$(MAX_AGE)")

audit: ## pip-audit each lock of IMAGE (or ALL=1); STRICT=1 fails on any finding
	$(SHIP) audit $(if $(ALL),--all,$(IMAGE_OPT)) $(if $(STRICT),--strict)

lab: ## run the lab image of IMAGE (make build IMAGE=<lab entry> first) on the GPUs, WORKSPACE mounted
	tag=$(call show,lab-tag); \
	token=$${JUPYTER_TOKEN:-$$($(PYTHON) -c 'import secrets; print(secrets.token_hex(24))')}; \
	echo "lab: http://127.0.0.1:$(LAB_PORT)/lab?token=$$token  (workspace $(WORKSPACE) at /home/stackproof/work)"; \
	tty=$$([ -t 0 ] && echo --interactive --tty || true); \
	JUPYTER_TOKEN="$$token" $(DOCKER) run --rm $$tty $(GPU_FLAGS) $(RUN_FLAGS) -e JUPYTER_TOKEN \
	    -p "127.0.0.1:$(LAB_PORT):8888" -v "$(WORKSPACE):/home/stackproof/work" "$$tag"
