#!/bin/sh
# Entrypoint of the lab image: JupyterLab on 0.0.0.0:$JUPYTER_PORT, only with a token.
#   docker run -e JUPYTER_TOKEN=<secret> -p 8888:8888 IMAGE          -> jupyter lab
#   docker run IMAGE jupyter nbconvert ... | bash | python3 ...        -> run as is
set -eu

if [ "$#" -gt 0 ]; then
    exec "$@"
fi
# No token, no server: an open Jupyter runs arbitrary code for anyone who can reach the port.
if [ -z "${JUPYTER_TOKEN:-}" ]; then
    echo "error: JUPYTER_TOKEN is empty; the lab refuses to start without a token." >&2
    echo "fix: docker run -e JUPYTER_TOKEN=\"\$(openssl rand -hex 24)\" ... (make lab makes one for you)" >&2
    exit 2
fi
# jupyter_server reads the token from JUPYTER_TOKEN itself, so it never shows up in the process list.
exec jupyter lab --ip=0.0.0.0 --port="${JUPYTER_PORT:-8888}" --no-browser \
    --ServerApp.root_dir=/home/stackproof/work --ServerApp.allow_remote_access=True
