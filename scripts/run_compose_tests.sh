#!/usr/bin/env bash
# `make test-compose`: docker-compose.yml run for real (tests/compose).
#
#   scripts/run_compose_tests.sh [pytest args...]
#
# 1. scripts/docker_up.sh: Docker (Debian's docker.io) and Compose v2 when missing; dockerd when no
#    daemon answers.
# 2. scripts/build_images.sh (make images): rollout-fleet:latest and the Redis and Prometheus
#    stand-ins, with no registry; cached outside the repo, so a second run only rebuilds what changed.
# 3. pytest -m compose tests/compose: one compose project (its own name, password and host ports)
#    for the whole run, taken down with its volumes at the end whatever happened.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-.venv/bin/python}"
bash scripts/docker_up.sh
bash scripts/build_images.sh
exec "$PY" -m pytest -q -m compose -p no:cacheprovider tests/compose "$@"
