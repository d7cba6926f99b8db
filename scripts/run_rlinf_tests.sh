#!/usr/bin/env bash
# The RLinf tier: RLinf 0.3's own world-model env base class (BaseWorldEnv), env lookup
# (rlinf.envs.get_env_cls) and action preparation (rlinf.envs.action_utils.prepare_actions) through
# the fleet.
#
#   scripts/run_rlinf_tests.sh [pytest args...]
#
# 1. scripts/setup_rlinf_env.sh (idempotent; the venv lives outside the repo, see that script)
# 2. pytest -m rlinf tests/rlinf with the RLinf venv's python
# The tests start their own Redis and in-process workers (the reference world engine) and stop them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="$(bash scripts/setup_rlinf_env.sh)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1
exec "$PY" -m pytest -q -m rlinf -p no:cacheprovider tests/rlinf "$@"
