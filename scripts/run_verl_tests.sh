#!/usr/bin/env bash
# The verl tier: verl's own agent loops (SingleTurnAgentLoop, ToolAgentLoop) through the fleet.
#
#   scripts/run_verl_tests.sh [pytest args...]
#
# 1. scripts/setup_verl_env.sh (idempotent; the venv lives outside the repo, see that script)
# 2. pytest -m verl tests/verl with the verl venv's python
# The tests start their own Redis and in-process workers (reference LM, scripted LM) and stop them;
# tests/verl/test_verl_vllm.py also starts a vLLM worker process (and vLLM's offline anchor) with the
# engines venv's python ($ROLLOUT_FLEET_ENGINES_VENV, built by scripts/setup_engines_env.sh: the
# engines tier runs first in CI).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="$(bash scripts/setup_verl_env.sh)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1
exec "$PY" -m pytest -q -m verl -p no:cacheprovider tests/verl "$@"
