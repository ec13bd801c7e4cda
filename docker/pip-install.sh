#!/bin/sh
# pip install for the image layers, run from a RUN with these BuildKit mounts (nothing here lands in a layer):
#   secret pip_ca        a CA bundle for a TLS-intercepting proxy
#   secret pip_index_url a private index URL (may carry credentials)
#   bind   /wheelhouse   wheels from `make wheelhouse`: when it holds any, pip installs offline from it
# Usage: pip-install.sh PYTHON PIP_INSTALL_ARGS...   (always hash-checked and binary-only)
set -eu
python=$1
shift
if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi
if [ -s /run/secrets/pip_index_url ]; then PIP_INDEX_URL="$(cat /run/secrets/pip_index_url)"; export PIP_INDEX_URL; fi
set --  --require-hashes --only-binary=:all: "$@"
if ls /wheelhouse/*.whl >/dev/null 2>&1; then set -- --no-index --find-links /wheelhouse "$@"; fi
set -x
exec "$python" -m pip install "$@"
