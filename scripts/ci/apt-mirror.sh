#!/usr/bin/env bash
# apt-get indextargets --format takes $(FIELD) literally.
# shellcheck disable=SC2016
# Print the archive URL to debootstrap DISTRO (debian | ubuntu) from: $DEBIAN_MIRROR / $UBUNTU_MIRROR when set,
# else this machine's own apt sources (apt's reading of sources.list and sources.list.d, one-line or deb822),
# when the machine runs that distro: the URI serving its own release. No mirror's host name is written here.
# Usage: scripts/ci/apt-mirror.sh debian|ubuntu
set -euo pipefail

distro="${1:?usage: $0 debian|ubuntu}"
var="${distro^^}_MIRROR"
if [ -n "${!var:-}" ]; then
    printf '%s\n' "${!var%/}"
    exit 0
fi
# shellcheck disable=SC1091
. /etc/os-release
uri=""
if [ "${ID:-}" = "$distro" ] && [ -n "${VERSION_CODENAME:-}" ]; then
    uri="$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 2>/dev/null \
        | awk -v release="$VERSION_CODENAME" '$1 == release { print $2; exit }')"
fi
if [ -z "$uri" ]; then
    printf 'apt-mirror: error: no %s archive to use: expected %s, or apt sources on this machine naming one; found %s %s with %s\n' \
        "$distro" "$var" "${ID:-unknown}" "${VERSION_CODENAME:-}" \
        "$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null | sort -u | tr '\n' ';' || echo 'no apt')" >&2
    printf 'apt-mirror: fix: set %s=<the %s archive URL your machines use>\n' "$var" "$distro" >&2
    exit 1
fi
printf '%s\n' "${uri%/}"
