#!/usr/bin/env bash
# Install and start a Docker engine with buildx on a fresh Debian host (CI runs this as root).
# Idempotent: a second run finds the packages installed and the daemon answering, and returns.
#
# Why trixie: bookworm's docker.io ships no buildx; trixie's docker.io + docker-buildx do. The trixie
# source is pinned at priority 100 so nothing else on the host is upgraded from it.
#
# Env: DOCKER_WAIT_S (default 60) how long to wait for the daemon; DOCKERD_LOG (default /var/log/dockerd.log).
set -euo pipefail

DOCKER_WAIT_S="${DOCKER_WAIT_S:-60}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"

log() { printf 'docker-engine: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (installs packages and starts dockerd)"

have_engine() {
    # A daemon answers and buildx is a working CLI plugin.
    docker info >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1
}

if have_engine; then
    log "engine already running: $(docker version --format '{{.Server.Version}}'), $(docker buildx version)"
    exit 0
fi

if ! command -v dockerd >/dev/null 2>&1 || [ ! -x /usr/libexec/docker/cli-plugins/docker-buildx ]; then
    if ! grep -rqs '^Suites:.*\btrixie\b' /etc/apt/sources.list.d/; then
        # The machine's own Debian mirror (its apt sources), so a corporate mirror is used without a flag.
        mirror="$("$(dirname "$0")/apt-mirror.sh" debian)" || die "no Debian mirror for the trixie source (above)"
        log "adding the Debian trixie apt source from $mirror (pinned at priority 100)"
        cat >/etc/apt/sources.list.d/stackproof-trixie.sources <<SRC
Types: deb
URIs: $mirror
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    cat >/etc/apt/preferences.d/stackproof-trixie <<'PIN'
# Only packages asked for with -t trixie come from trixie.
Package: *
Pin: release n=trixie
Pin-Priority: 100
PIN
    log "installing docker.io + docker-buildx from trixie"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends -t trixie \
        docker.io docker-buildx containerd runc iptables ca-certificates >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    log "starting dockerd in the background (log: $DOCKERD_LOG)"
    # No systemd in CI containers: run the daemon directly, detached from this shell.
    nohup dockerd >"$DOCKERD_LOG" 2>&1 &
    deadline=$((SECONDS + DOCKER_WAIT_S))
    until docker info >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 30 "$DOCKERD_LOG" >&2 || true
            die "dockerd did not answer within ${DOCKER_WAIT_S}s (log above)"
        fi
        sleep 1
    done
fi

# /usr/local/bin/docker (if present) shadows /usr/bin/docker; either finds buildx in /usr/libexec/docker/cli-plugins.
docker buildx version >/dev/null 2>&1 \
    || die "docker buildx not found as a CLI plugin (client: $(command -v docker)); expected /usr/libexec/docker/cli-plugins/docker-buildx"
log "ready: client $(docker version --format '{{.Client.Version}}'), server $(docker version --format '{{.Server.Version}}'), $(docker buildx version)"
