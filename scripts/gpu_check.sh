#!/usr/bin/env bash
# The GPU check: the reference engines on CUDA, bitwise batch invariance, a fleet worker's steps equal
# to the engine called directly, and the step latency (bench/gpu_check.py does the work).
#
#   scripts/gpu_check.sh [bench.gpu_check options, e.g. --sessions 16 --steps 8 --device cuda:1]
#
# PYTHON: the interpreter with torch (CUDA build) and the project's dependencies; default: the
# engines venv (~/.cache/rollout-fleet/engines-venv, scripts/setup_engines_env.sh), else python3.
# GPU_CHECK_TIMEOUT_S: the bound of the whole run (default 570 s: it fits in 10 minutes).
# Exit 0: every check passed; 1: a check failed (the line says which); 2: no GPU or no engines here
# (said within seconds, before anything is started).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_PY="${ROLLOUT_FLEET_CACHE:-$HOME/.cache/rollout-fleet}/engines-venv/bin/python"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$VENV_PY" ]]; then PYTHON="$VENV_PY"; else PYTHON="$(command -v python3 || true)"; fi
fi

no() { echo "gpu_check: $1" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || no "NO GPU: nvidia-smi is not installed (this check needs an NVIDIA GPU and its driver)"
timeout 20 nvidia-smi -L >/dev/null 2>&1 || no "NO GPU: nvidia-smi -L lists no GPU (driver not loaded, or no device visible)"
[[ -n "$PYTHON" && -x "$PYTHON" ]] || no "NO ENGINES: no python found (set PYTHON=..., or run scripts/setup_engines_env.sh)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
timeout 60 "$PYTHON" -c "import torch, redis, msgpack, workers.engines.reference" >/dev/null 2>&1 \
  || no "NO ENGINES: $PYTHON cannot import torch and the project (set PYTHON=..., or run scripts/setup_engines_env.sh)"
timeout 60 "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || no "NO GPU: torch.cuda.is_available() is False for $PYTHON (a CPU-only torch build, or no visible device)"

cd "$ROOT"
exec timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-570}" "$PYTHON" -m bench.gpu_check "$@"
