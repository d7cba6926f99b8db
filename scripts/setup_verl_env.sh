#!/usr/bin/env bash
# The verl venv: the real verl package (agent loops) + this project, for the verl test tier.
#
#   scripts/setup_verl_env.sh            # creates or reuses the venv, prints its python
#
# One command, idempotent. The venv lives OUTSIDE the repo:
#   ${ROLLOUT_FLEET_VERL_VENV:-$HOME/.cache/rollout-fleet/verl-venv}
# A stamp file records what was installed; a second run with the same inputs does nothing.
#
# verl is installed with --no-deps: its full requirement list (wandb, tensorboard, peft, datasets
# with pyarrow, ray[default] with its dashboard, ...) is for training. What stays is what the modules
# that the agent loops import at import time need (verl.experimental.agent_loop and what it imports),
# listed in VERL_IMPORT_DEPS below. torch is pinned to the CPU wheel (without the pin pip picks a
# CUDA torch), as scripts/setup_engines_env.sh does.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_FLEET_VERL_VENV:-$HOME/.cache/rollout-fleet/verl-venv}"
PYTHON_BIN="${PYTHON:-python3}"
VERL_VERSION="0.9.1"
TORCH_PIN="torch==2.13.0+cpu"
# The import-time needs of verl.experimental.agent_loop (agent_loop.py, single_turn_agent_loop.py,
# tool_agent_loop.py and the verl modules they import); the bounds are verl 0.9.1's own.
VERL_IMPORT_DEPS=(
  "ray>=2.41.0" "hydra-core" "omegaconf" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0"
  "numpy>=2.0.0" "pandas" "pyarrow>=19.0.0" "datasets" "codetiming" "dill" "pillow" "pydantic" "packaging>=20.0"
  "torchdata" "accelerate" "peft" "pylatexenc" "tokenizers" "cachetools"
)
# shellcheck source=venv_common.sh
source "$REPO/scripts/venv_common.sh"
venv_begin verl "verl==$VERL_VERSION ${VERL_IMPORT_DEPS[*]}"

log "installing verl==$VERL_VERSION (--no-deps)"
"$PY" -m pip install --quiet --no-deps "verl==$VERL_VERSION" >&2
log "installing verl's import-time dependencies ($TORCH_PIN)"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN" "${VERL_IMPORT_DEPS[@]}" >&2

log "installing the project (editable, [dev])"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" -e "$REPO[dev]" >&2

log "checking imports"
"$PY" - <<'EOF' >&2
import torch
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop  # noqa: F401
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: F401
import verl
assert "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "verl", verl.__version__)
EOF

venv_finish
