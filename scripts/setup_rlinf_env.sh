#!/usr/bin/env bash
# The RLinf venv: the real rlinf package (world-model env base class, env registry, action
# preparation) + this project, for the RLinf test tier.
#
#   scripts/setup_rlinf_env.sh           # creates or reuses the venv, prints its python
#
# One command, idempotent. The venv lives OUTSIDE the repo:
#   ${ROLLOUT_FLEET_RLINF_VENV:-$HOME/.cache/rollout-fleet/rlinf-venv}
# A stamp file records what was installed; a second run with the same inputs does nothing.
#
# rlinf is installed with --no-deps: its requirement list (wandb, swanlab, tensorboard, nvitop,
# liger_kernel, gsutil, ...) is for training on GPUs. What stays is what the modules the fleet env
# imports need at import time (rlinf.envs, rlinf.envs.world_model.base_world_env with
# rlinf.scheduler, rlinf.envs.action_utils with rlinf.config), listed in RLINF_IMPORT_DEPS below.
# torch is pinned to the CPU wheel (without the pin pip picks a CUDA torch).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_FLEET_RLINF_VENV:-$HOME/.cache/rollout-fleet/rlinf-venv}"
PYTHON_BIN="${PYTHON:-python3}"
RLINF_VERSION="0.3.0"
TORCH_PIN="torch==2.13.0+cpu"
# The import-time needs of the rlinf modules above; the ray bound is rlinf 0.3.0's own.
RLINF_IMPORT_DEPS=(
  "ray>=2.47.0" "omegaconf" "hydra-core" "numpy" "pyyaml" "packaging" "pillow" "scipy" "requests" "aiohttp"
  "typing_extensions"
)
# shellcheck source=venv_common.sh
source "$REPO/scripts/venv_common.sh"
venv_begin rlinf "rlinf==$RLINF_VERSION ${RLINF_IMPORT_DEPS[*]}"

log "installing rlinf==$RLINF_VERSION (--no-deps)"
"$PY" -m pip install --quiet --no-deps "rlinf==$RLINF_VERSION" >&2
log "installing rlinf's import-time dependencies ($TORCH_PIN)"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN" "${RLINF_IMPORT_DEPS[@]}" >&2

log "installing the project (editable, [dev])"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" -e "$REPO[dev]" >&2

log "checking imports"
"$PY" - <<'PYEOF' >&2
import torch
from rlinf.envs import SupportedEnvType, get_env_cls  # noqa: F401
from rlinf.envs.action_utils import prepare_actions  # noqa: F401
from rlinf.envs.world_model.base_world_env import BaseWorldEnv  # noqa: F401
import importlib.metadata
assert "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "rlinf", importlib.metadata.version("rlinf"))
PYEOF

venv_finish
