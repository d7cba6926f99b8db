#!/usr/bin/env bash
# The Ray tier: the Ray launcher (workers.ray_fleet, rollout-fleet ray) on a local Ray cluster of
# several nodes started by the tests (ray.cluster_utils.Cluster, CPU only, no dashboard).
#
#   scripts/run_ray_tests.sh [pytest args...]
#
# 1. scripts/setup_ray_env.sh (idempotent; the venv lives outside the repo, see that script)
# 2. pytest -m ray tests/ray with the Ray venv's python
# The tests start their own Redis and Ray nodes and stop them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="$(bash scripts/setup_ray_env.sh)"
export RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 RAY_DEDUP_LOGS=0
unset RAY_ADDRESS  # the tests' own cluster, never one this shell points at
exec "$PY" -m pytest -q -m ray -p no:cacheprovider tests/ray "$@"
