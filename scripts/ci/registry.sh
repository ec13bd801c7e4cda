#!/usr/bin/env bash
# A real OCI registry on this host for the shipping tests (make push / sign / verify), plus the tools they use:
# Debian's docker-registry (the CNCF distribution registry), skopeo and cosign.
# Idempotent: a second run finds the registry answering on its port and returns.
#
# Usage: scripts/ci/registry.sh     # listens on 127.0.0.1:${STACKPROOF_REGISTRY_PORT:-5000}, prints host:port
# Env:   STACKPROOF_REGISTRY_PORT (default 5000);
#        STACKPROOF_REGISTRY_DIR (default /var/lib/stackproof-registry): storage, config and log;
#        STACKPROOF_REGISTRY_WAIT_S (default 30): how long to wait for it to answer.
# (Not REGISTRY_*: the registry reads those as overrides of its own configuration.)
# Plain HTTP on loopback only: docker, skopeo (--tls-verify=false) and cosign treat localhost as insecure.
set -euo pipefail

STACKPROOF_REGISTRY_PORT="${STACKPROOF_REGISTRY_PORT:-5000}"
STACKPROOF_REGISTRY_DIR="${STACKPROOF_REGISTRY_DIR:-/var/lib/stackproof-registry}"
STACKPROOF_REGISTRY_WAIT_S="${STACKPROOF_REGISTRY_WAIT_S:-30}"
address="127.0.0.1:${STACKPROOF_REGISTRY_PORT}"

log() { printf 'registry: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

answers() { curl --silent --fail --max-time 5 --output /dev/null "http://${address}/v2/"; }

[ "$(id -u)" = 0 ] || die "run as root (installs packages)"

missing=()
for tool in docker-registry:docker-registry skopeo:skopeo cosign:cosign curl:curl; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    # cosign is only in trixie; docker-engine.sh adds trixie pinned at priority 100, so -t trixie when it is there.
    release=()
    if grep -rqs '^Suites:.*\btrixie\b' /etc/apt/sources.list.d/; then release=(-t trixie); fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${release[@]}" "${missing[@]}" >/dev/null
fi

if answers; then
    log "already answering on ${address}"
    echo "$address"
    exit 0
fi

mkdir -p "$STACKPROOF_REGISTRY_DIR/storage"
# No auth, deletes allowed (tests delete what they push), bound to loopback only.
cat >"$STACKPROOF_REGISTRY_DIR/config.yml" <<CONFIG
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: ${STACKPROOF_REGISTRY_DIR}/storage
  delete:
    enabled: true
http:
  addr: ${address}
CONFIG
log "starting docker-registry on ${address} (log: ${STACKPROOF_REGISTRY_DIR}/registry.log)"
nohup docker-registry serve "$STACKPROOF_REGISTRY_DIR/config.yml" >"$STACKPROOF_REGISTRY_DIR/registry.log" 2>&1 &
deadline=$((SECONDS + STACKPROOF_REGISTRY_WAIT_S))
until answers; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        tail -n 20 "$STACKPROOF_REGISTRY_DIR/registry.log" >&2 || true
        die "docker-registry did not answer on http://${address}/v2/ within ${STACKPROOF_REGISTRY_WAIT_S}s (log above); is the port taken? set STACKPROOF_REGISTRY_PORT"
    fi
    sleep 0.5
done
log "ready: $(docker-registry --version 2>/dev/null || true), $(skopeo --version)"
echo "$address"
