#!/usr/bin/env bash
# The real-engine test tier: vLLM (CPU build) and vLLM-Omni, for real, on this machine's CPUs.
#
#   scripts/run_engine_tests.sh [pytest args...]
#
# 1. scripts/setup_engines_env.sh (idempotent; the venv lives outside the repo, see that script)
# 2. pytest -m engines tests/engines with the engines venv's python
# The tests start their own Redis, vLLM server (tiny local Llama, made by scripts/make_tiny_model.py
# into ~/.cache/rollout-fleet) and vLLM-Omni rollout server on free ports, and stop them at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="$(bash scripts/setup_engines_env.sh)"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# timeout_func_only: pytest-timeout's 300 s bounds each test's own body, not the shared fixtures
# (model builds, a vLLM server, vLLM's offline answers, an in-process engine: 5 minutes together
# on a slow 2-core VM, all charged to whichever test needs them first). Those fixtures wait with
# their own bounds (STARTUP_S in tests/engines/conftest.py, vLLM's own engine-start timeout).
exec "$PY" -m pytest -q -m engines -p no:cacheprovider -o timeout_func_only=true tests/engines "$@"
