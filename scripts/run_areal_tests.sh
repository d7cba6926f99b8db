#!/usr/bin/env bash
# The AReaL tier: AReaL's own rollout workflows (RLVRWorkflow, MultiTurnWorkflow) through the fleet.
#
#   scripts/run_areal_tests.sh [pytest args...]
#
# 1. scripts/setup_areal_env.sh (idempotent; the venv lives outside the repo, see that script)
# 2. pytest -m areal tests/areal with the AReaL venv's python
# The tests start their own Redis and in-process workers (reference LM, scripted LM) and stop them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="$(bash scripts/setup_areal_env.sh)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 WANDB_MODE=disabled
exec "$PY" -m pytest -q -m areal -p no:cacheprovider tests/areal "$@"
