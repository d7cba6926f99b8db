#!/usr/bin/env bash
# `make images`: every image docker-compose.yml needs, built with no image registry at all.
#
#   bash scripts/build_images.sh
#
# 1. A base image made from Debian packages: debootstrap --variant=minbase bookworm with python3,
#    python3-venv, redis-server and prometheus, imported with `docker import`. Its tarball is cached
#    in $CACHE under a key of what built it (suite, packages, mirror), so a second run imports it
#    (or finds the image) instead of bootstrapping again.
# 2. A wheelhouse built on the host (pip wheel, cp311 like Debian's python3) for the image's extras:
#    cached in $CACHE under a key of pyproject.toml and the pins; the CPU torch wheel is the one
#    pip finds here (torch==2.13.0 resolves to the +cpu build on this project's machines).
# 3. docker build of rollout-fleet:latest from the Dockerfile with BASE=<the Debian base> and
#    WHEELS=/tmp/wheels (pip --no-index inside the build: no network), and of the stand-ins in
#    deploy/images/: rollout-fleet-redis:local (Debian's redis-server 7.0) and
#    rollout-fleet-prometheus:local (Debian's prometheus 2.42). Grafana is not packaged by Debian:
#    the monitoring profile's Grafana needs the official image.
# The same docker-compose.yml runs these images when .env (or the environment) says
#   REDIS_IMAGE=rollout-fleet-redis:local  PROMETHEUS_IMAGE=rollout-fleet-prometheus:local
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"

CACHE="${ROLLOUT_FLEET_IMAGE_CACHE:-$HOME/.cache/rollout-fleet/images}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,redis-server,prometheus,ca-certificates
EXTRAS=reference,gateway,http
# The pins the image installs, the build requirements of the project (pyproject.toml [build-system]),
# and async-timeout: redis-py needs it on Debian's python3 3.11.2 (< 3.11.3), not on the host's newer 3.11.
PINS=("torch==2.13.0" "setuptools>=68" "wheel" "async-timeout>=4.0.3")
export DOCKER_BUILDKIT=0  # the classic builder: the same on every docker CLI, needs no buildx

log() { echo "[build_images $(date +%H:%M:%S)] $*" >&2; }
key() { sha256sum | cut -c1-16; }

base_image() {  # prints the base image's name, building it when neither it nor its tarball exists
  local k tag tarball rootfs
  k="$(echo "$SUITE $MIRROR $PACKAGES minbase v1" | key)"
  tag="rollout-fleet-base:$k"
  tarball="$CACHE/base-$k.tar"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    if [[ ! -s "$tarball" ]]; then
      command -v debootstrap >/dev/null 2>&1 || {
        log "installing debootstrap"; apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
      rootfs="$CACHE/rootfs-$k.tmp"
      rm -rf "$rootfs"
      log "debootstrap $SUITE (minbase + $PACKAGES): a few minutes, once"
      debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$CACHE/debootstrap-$k.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap-$k.log" >&2; return 1; }
      rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
      tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
      rm -rf "$rootfs"
    fi
    log "importing $tarball as $tag"
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["/bin/bash"]' "$tarball" "$tag" >/dev/null
  fi
  echo "$tag"
}

requirements() {  # the image's requirements: pyproject.toml's dependencies and its extras, and PINS
  python3 - "$EXTRAS" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1].split(","):
    reqs += [r for r in project["optional-dependencies"][extra] if not r.startswith("rollout-fleet")]
print("\n".join(sorted(set(reqs))))
PY
  [[ $? -eq 0 ]] || return 1
  printf '%s\n' "${PINS[@]}"
}

wheelhouse() {  # prints the wheelhouse folder, building it when its key changed
  local k dir reqs
  python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { log "python3 must be 3.11 (Debian bookworm's python3 is 3.11): $(python3 --version)"; return 1; }
  reqs="$(requirements)"
  k="$( { echo "$reqs"; python3 -m pip --version | cut -d' ' -f2; uname -m; } | key)"
  dir="$CACHE/wheels-$k"
  if [[ ! -f "$dir/.complete" ]]; then
    log "building the wheelhouse $dir (pip wheel on the host, once per pyproject.toml)"
    rm -rf "$dir" && mkdir -p "$dir"
    echo "$reqs" > "$dir/requirements.txt"
    python3 -m pip wheel --quiet --wheel-dir "$dir" -r "$dir/requirements.txt" >&2
    touch "$dir/.complete"
  fi
  echo "$dir"
}

link_wheels() {  # the build context's deploy/images/wheels/: hard links into the cache (a copy across filesystems)
  rm -rf deploy/images/wheels
  mkdir -p deploy/images/wheels
  cp -l "$1"/*.whl deploy/images/wheels/ 2>/dev/null || cp "$1"/*.whl deploy/images/wheels/
}

main() {
  mkdir -p "$CACHE"
  bash "$REPO/scripts/docker_up.sh"
  local base wheels
  base="$(base_image)"
  wheels="$(wheelhouse)"
  trap 'rm -rf "$REPO/deploy/images/wheels"' EXIT
  link_wheels "$wheels"
  log "building rollout-fleet:latest on $base"
  docker build --quiet -t rollout-fleet:latest --build-arg BASE="$base" --build-arg WHEELS=/tmp/wheels . >/dev/null
  log "building the stand-ins rollout-fleet-redis:local and rollout-fleet-prometheus:local"
  # No build context (the Dockerfile on stdin): they copy nothing in.
  docker build --quiet -t rollout-fleet-redis:local --build-arg BASE="$base" - <deploy/images/redis.Dockerfile >/dev/null
  docker build --quiet -t rollout-fleet-prometheus:local --build-arg BASE="$base" - \
    <deploy/images/prometheus.Dockerfile >/dev/null
  docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^rollout-fleet(-redis|-prometheus)?:(latest|local) ' >&2
  echo "make images: done. For docker compose, in .env:"
  echo "  REDIS_IMAGE=rollout-fleet-redis:local"
  echo "  PROMETHEUS_IMAGE=rollout-fleet-prometheus:local"
}

main "$@"
