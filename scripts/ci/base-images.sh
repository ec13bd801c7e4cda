#!/usr/bin/env bash
# Provide base images locally when no registry can be reached: debootstrap a Debian minbase and
# `docker import` it under exactly the FROM name the matrix uses, so the Dockerfiles build unchanged.
#
# Usage: scripts/ci/base-images.sh [IMAGE_REF ...]
#   default: the base of the matrix's default image (images/matrix.toml), e.g. debian:trixie-slim.
# Only Debian refs (debian:<suite>[-slim]) can be made this way; others must be pulled or loaded.
# Skips a ref that already exists. Needs root (debootstrap) and a running engine (scripts/ci/docker-engine.sh).
set -euo pipefail

cd "$(dirname "$0")/../.."
log() { printf 'base-images: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap needs it)"
docker info >/dev/null 2>&1 || die "no Docker engine answers; run scripts/ci/docker-engine.sh first"

PY="${PYTHON:-python3}"
if [ "$#" -eq 0 ]; then
    # The matrix is the single source of truth for the FROM name.
    set -- "$("$PY" -c 'from stackproof.images.matrix import load_matrix; print(load_matrix().default_image.base)')"
fi

MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

for ref in "$@"; do
    if docker image inspect "$ref" >/dev/null 2>&1; then
        log "$ref: already present, skipped"
        continue
    fi
    case "$ref" in
        debian:*) suite="${ref#debian:}"; suite="${suite%-slim}" ;;
        *) die "$ref: only debian:<suite>[-slim] can be made with debootstrap; pull or 'docker load' it instead" ;;
    esac
    if ! command -v debootstrap >/dev/null 2>&1; then
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; }
    fi
    root="$(mktemp -d /tmp/stackproof-rootfs.XXXXXX)"
    trap 'rm -rf "$root"' EXIT
    log "$ref: debootstrap --variant=minbase $suite (mirror $MIRROR)"
    debootstrap --variant=minbase "$suite" "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -n 30 "$root.log" >&2; die "$ref: debootstrap $suite failed (log above)"; }
    # Like the official -slim images: no apt lists or caches in the base.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -c . | docker import \
        --change 'CMD ["bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$ref" >/dev/null
    rm -rf "$root" "$root.log"
    trap - EXIT
    log "$ref: imported ($(docker image inspect --format '{{.Size}}' "$ref") bytes)"
done
