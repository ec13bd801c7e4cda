#!/usr/bin/env bash
# Provide base images locally when no registry can be reached: debootstrap a Debian minbase and
# `docker import` it under exactly the FROM name the matrix uses, so the Dockerfiles build unchanged.
#
# Usage: scripts/ci/base-images.sh [IMAGE_REF ...]
#   default: the base of the matrix's default image (images/matrix.toml), e.g. debian:trixie-slim.
# Makes debian:<suite>[-slim] and ubuntu:<YY.MM|codename> from the archive scripts/ci/apt-mirror.sh names
# (DEBIAN_MIRROR / UBUNTU_MIRROR, else this machine's apt sources); other refs (nvidia/cuda:...) must be pulled
# or `docker load`ed.
# Skips a ref that already exists. Needs root (debootstrap) and a running engine (scripts/ci/docker-engine.sh).
set -euo pipefail

cd "$(dirname "$0")/../.."
log() { printf 'base-images: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap needs it)"
docker info >/dev/null 2>&1 || die "no Docker engine answers; run scripts/ci/docker-engine.sh first"

PY="${PYTHON:-python3}"
if [ "$#" -eq 0 ]; then
    "$PY" -c 'import tomllib' 2>/dev/null || die "$PY (Python >= 3.11) is needed to read images/matrix.toml; set PYTHON= or pass the image refs"
    # The matrix is the single source of truth for the FROM name.
    set -- "$("$PY" -c 'from stackproof.images.matrix import load_matrix; print(load_matrix().default_image.base)')"
fi

for ref in "$@"; do
    if docker image inspect "$ref" >/dev/null 2>&1; then
        log "$ref: already present, skipped"
        continue
    fi
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    case "$ref" in
        debian:*) distro=debian; suite="${ref#debian:}"; suite="${suite%-slim}" ;;
        ubuntu:*)
            distro=ubuntu; suite="${ref#ubuntu:}"
            keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg
            case "$suite" in
                20.04) suite=focal ;; 22.04) suite=jammy ;; 24.04) suite=noble ;; 26.04) suite=resolute ;;
                [0-9]*) die "$ref: unknown Ubuntu release; pass its codename, e.g. ubuntu:noble" ;;
            esac ;;
        *) die "$ref: only debian:<suite>[-slim] and ubuntu:<release> can be made with debootstrap; pull or 'docker load' it" ;;
    esac
    mirror="$(scripts/ci/apt-mirror.sh "$distro")" || die "$ref: no $distro archive to debootstrap from (above)"
    need=(debootstrap)
    [ "$distro" = ubuntu ] && need+=(ubuntu-keyring)
    if ! command -v debootstrap >/dev/null 2>&1 || [ ! -f "$keyring" ]; then
        log "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
    fi
    # Older debootstraps lack scripts for newer Ubuntu releases; every Ubuntu script is the same as gutsy.
    script=()
    if [ ! -e "/usr/share/debootstrap/scripts/$suite" ] && [ "$distro" = ubuntu ]; then
        script=(/usr/share/debootstrap/scripts/gutsy)
    fi
    root="$(mktemp -d /tmp/stackproof-rootfs.XXXXXX)"
    trap 'rm -rf "$root" "$root.log"' EXIT
    log "$ref: debootstrap --variant=minbase $suite (mirror $mirror)"
    debootstrap --variant=minbase --keyring="$keyring" "$suite" "$root" "$mirror" "${script[@]}" >"$root.log" 2>&1 \
        || { tail -n 30 "$root.log" >&2; die "$ref: debootstrap $suite failed (log above)"; }
    if [ "$distro" = ubuntu ]; then
        # As in the official image: updates, security and universe (tini lives there).
        printf 'deb %s %s main restricted universe multiverse\n' \
            "$mirror" "$suite" "$mirror" "$suite-updates" "$mirror" "$suite-security" >"$root/etc/apt/sources.list"
    fi
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
