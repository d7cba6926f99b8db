#!/usr/bin/env bash
# The AReaL venv: the real areal package (its workflows and InferenceEngine API) + this project, for
# the AReaL test tier.
#
#   scripts/setup_areal_env.sh           # creates or reuses the venv, prints its python
#
# One command, idempotent. The venv lives OUTSIDE the repo:
#   ${ROLLOUT_FLEET_AREAL_VENV:-$HOME/.cache/rollout-fleet/areal-venv}
# A stamp file records what was installed; a second run with the same inputs does nothing.
#
# areal is installed with --no-deps: its full requirement list (sglang/vllm launchers' extras, wandb,
# swanlab, litellm, openhands, agent SDKs, ...) is for training clusters. What stays is what importing
# the modules the tests use needs (areal.api, areal.workflow.rlvr, areal.workflow.multi_turn and
# areal.infra.remote_inf_engine; areal/__init__ imports all of areal.infra, and with areal.api.cli_args
# they pull ray, flask, fastapi, numba, openai, ...), listed in
# AREAL_IMPORT_DEPS below from areal 1.0.4's imports (a superset: not pared down one by one). torch
# is pinned to the CPU wheel (without the pin pip picks a CUDA torch), as the other setup scripts do.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_FLEET_AREAL_VENV:-$HOME/.cache/rollout-fleet/areal-venv}"
PYTHON_BIN="${PYTHON:-python3}"
AREAL_VERSION="1.0.4"
TORCH_PIN="torch==2.13.0+cpu"
# The import-time needs of those modules; the pins (hydra-core, omegaconf, math-verify, transformers)
# are areal 1.0.4's own requirements.
AREAL_IMPORT_DEPS=(
  "transformers>=5.0.0,<=5.3.0" "torchdata" "numpy" "pillow" "hydra-core==1.4.0.dev1" "omegaconf==2.4.0.dev2"
  "uvloop>=0.21.0" "pyyaml" "aiohttp>=3.13.3,<4" "requests" "httpx" "orjson" "pydantic" "psutil" "colorlog"
  "ray" "flask" "fastapi" "uvicorn" "aiofiles" "tenacity" "tabulate" "packaging" "lark" "einops" "datasets"
  "huggingface-hub" "tokenizers" "pybase64" "msgspec" "pyzmq" "blosc" "math-verify==0.8.0" "regex" "numba" "openai"
)
# shellcheck source=venv_common.sh
source "$REPO/scripts/venv_common.sh"
venv_begin areal "areal==$AREAL_VERSION ${AREAL_IMPORT_DEPS[*]}"

log "installing areal==$AREAL_VERSION (--no-deps)"
"$PY" -m pip install --quiet --no-deps "areal==$AREAL_VERSION" >&2
log "installing areal's import-time dependencies ($TORCH_PIN)"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN" "${AREAL_IMPORT_DEPS[@]}" >&2

log "installing the project (editable, [dev])"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" -e "$REPO[dev]" >&2

log "checking imports"
"$PY" - <<'PYEOF' >&2
import torch
from areal.api import InferenceEngine, ModelRequest, ModelResponse  # noqa: F401
from areal.workflow.multi_turn import MultiTurnWorkflow  # noqa: F401
from areal.workflow.rlvr import RLVRWorkflow  # noqa: F401
from areal.infra.remote_inf_engine import GroupedRolloutWorkflow  # noqa: F401
import areal
assert "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "areal", areal.__version__)
PYEOF

venv_finish
