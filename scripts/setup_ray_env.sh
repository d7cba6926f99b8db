#!/usr/bin/env bash
# The Ray venv: Ray (core, no dashboard) + this project with the CPU reference engines, for the Ray
# launcher's test tier (tests/ray, a local multi-node Ray cluster on this machine).
#
#   scripts/setup_ray_env.sh            # creates or reuses the venv, prints its python
#
# One command, idempotent. The venv lives OUTSIDE the repo:
#   ${ROLLOUT_FLEET_RAY_VENV:-$HOME/.cache/rollout-fleet/ray-venv}
# A stamp file records what was installed; a second run with the same inputs does nothing.
# Ray is pinned (the launcher uses placement groups, named detached actors and
# ray.cluster_utils.Cluster); torch is pinned to the CPU wheel (without the pin pip picks a CUDA
# torch), as the other setup_*_env.sh scripts do.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_FLEET_RAY_VENV:-$HOME/.cache/rollout-fleet/ray-venv}"
PYTHON_BIN="${PYTHON:-python3}"
RAY_VERSION="2.60.0"
TORCH_PIN="torch==2.13.0+cpu"
# shellcheck source=venv_common.sh
source "$REPO/scripts/venv_common.sh"
venv_begin ray "ray==$RAY_VERSION"

log "installing ray==$RAY_VERSION and the project (editable, [reference,dev], $TORCH_PIN)"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "ray==$RAY_VERSION" "$TORCH_PIN" -e "$REPO[reference,dev]" >&2

log "checking imports"
"$PY" - <<'PYEOF' >&2
import ray
import torch
from ray.cluster_utils import Cluster  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("ray", ray.__version__, "torch", torch.__version__)
PYEOF

venv_finish
