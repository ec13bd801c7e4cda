#!/bin/sh
# Entrypoint of the validation image.
#   docker run IMAGE                      -> python3 -m stackproof validate
#   docker run IMAGE validate --help      -> python3 -m stackproof validate --help (any stackproof subcommand)
#   docker run IMAGE --version            -> python3 -m stackproof --version (a leading flag)
#   docker run IMAGE bash | python3 -c .. -> run as is
set -eu

# tini as PID 1 reaps zombies (DataLoader workers) and forwards signals; skipped under `docker run --init`.
if [ "$$" = 1 ] && tini="$(command -v tini 2>/dev/null)"; then
    exec "$tini" -- "$0" "$@"
fi

if [ "$#" -eq 0 ]; then
    exec python3 -m stackproof validate
fi
case "$1" in
    -*|validate|images) exec python3 -m stackproof "$@" ;;
esac
if command -v "$1" >/dev/null 2>&1; then
    exec "$@"
fi
# Neither a program nor a known subcommand: stackproof's own usage error lists the subcommands.
exec python3 -m stackproof "$@"
