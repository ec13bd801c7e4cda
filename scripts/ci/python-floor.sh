#!/usr/bin/env bash
# CI: prove the CLI and the CPU suite on the oldest Python the matrix names (the python of its oldest image,
# e.g. 3.10 for `legacy`), as that image's validation layer runs them: that image's lock (torch from the
# index pip is configured with, hash-checked) + the validation lock, and stackproof on PYTHONPATH.
#
# Usage: scripts/ci/python-floor.sh      (after make dev)
#   FLOOR_PYTHON=/path/to/python3.X   the interpreter (default: python3.X on PATH, else pyenv's)
#   FLOOR_K=EXPR                      which checks of the CPU suite (default: collectives but reduce_scatter with
#                                     max/min/product, which the legacy lock's torch 2.7.1 computes wrong on gloo:
#                                     it sums whatever the op, and the suite fails it, rightly; FLOOR_K= runs them
#                                     all, about 90 s more on 2 cores, most of it torch.compile)
# Reuses pip's cache; the venv (about 5 GB) is made in build/ and removed after a passing run.
set -euo pipefail
cd "$(dirname "$0")/../.."
log() { printf 'python-floor: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

PY="${PYTHON:-.venv/bin/python}"
read -r version image < <("$PY" -c 'from packaging.version import Version
from stackproof.images.matrix import load_matrix
oldest = min(load_matrix().images, key=lambda i: Version(i.python))
print(oldest.python, oldest.name)')

# FLOOR_PYTHON, else python3.X on PATH (a pyenv shim there may not run it), else pyenv's newest 3.X build.
interpreter=""
for candidate in ${FLOOR_PYTHON:-} "$(command -v "python$version" || true)" \
    $(find "${PYENV_ROOT:-$HOME/.pyenv}/versions" -maxdepth 3 -path "*/$version.*/bin/python$version" 2>/dev/null \
        | sort -rV); do
    found="$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
    if [ "$found" = "$version" ]; then interpreter="$candidate"; break; fi
done
[ -n "$interpreter" ] || die "no working python$version (the oldest Python in images/matrix.toml, image '$image') in FLOOR_PYTHON, on PATH or in pyenv; fix: pyenv install $version (or apt-get install python$version$( [ -n "${FLOOR_PYTHON:-}" ] && echo ", or correct FLOOR_PYTHON=$FLOOR_PYTHON"))"

venv="build/python$version"
rm -rf "$venv"
"$interpreter" -m venv "$venv"
started=$SECONDS
log "installing images/locks/$image.txt and images/locks/validation.txt into $venv ($("$interpreter" -V))"
"$venv/bin/python" -m pip install -q --require-hashes --no-deps --only-binary=:all: -r "images/locks/$image.txt"
"$venv/bin/python" -m pip install -q --require-hashes --only-binary=:all: -r images/locks/validation.txt
log "installed in $((SECONDS - started)) s ($(du -sh "$venv" | cut -f1))"

# As in the image: the package from the checkout on PYTHONPATH, not installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() { log "\$ $*"; "$@"; }
run "$venv/bin/python" -m stackproof --help >/dev/null
run "$venv/bin/python" -m stackproof images list
run "$venv/bin/python" -m stackproof images check --offline
started=$SECONDS
FLOOR_K="${FLOOR_K-collectives and not (reduce_scatter and (max or min or product))}"
# Messages up to 1 MiB: the floor proves the code on this Python, not gloo's large sizes (the main run does).
run "$venv/bin/python" -m stackproof validate --nproc 2 --expect-gpus 0 --max-check-bytes 1M --reports "$venv/reports" \
    ${FLOOR_K:+-k "$FLOOR_K"}
log "the CPU suite (${FLOOR_K:-all checks}) passed on Python $version in $((SECONDS - started)) s"
rm -rf "$venv"
