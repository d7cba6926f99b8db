# Shared by the setup_*_env.sh scripts: a venv cached outside the repo, reused while the stamp
# key (what the caller installs, the caller's script, this file and pyproject.toml) is unchanged.
# Sourced, not run. The caller sets REPO, VENV, PYTHON_BIN and TORCH_PIN, then calls
#   venv_begin NAME WHAT   # prints the python and exits 0 when up to date; else creates the venv
#                          # and writes $CONSTRAINTS (the CPU torch pin: without it pip picks CUDA)
#   ...its installs with "$PY" -m pip ... -c "$CONSTRAINTS"
#   venv_finish            # writes the stamp, prints the python
# log MESSAGE writes a timestamped line to stderr (stdout carries only the python's path).

venv_begin() {
  VENV_NAME="$1"
  PY="$VENV/bin/python"
  STAMP="$VENV/.rollout-fleet-$VENV_NAME.stamp"
  KEY="$({
    echo "$2 $TORCH_PIN repo=$REPO"
    cat "$REPO/scripts/setup_${VENV_NAME}_env.sh" "$REPO/scripts/venv_common.sh" "$REPO/pyproject.toml"
  } | sha256sum | cut -d' ' -f1)"
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" && -x "$PY" ]]; then
    echo "$VENV_NAME venv up to date: $VENV" >&2
    echo "$PY"
    exit 0
  fi
  mkdir -p "$(dirname "$VENV")"
  if [[ ! -x "$PY" ]]; then
    log "creating venv $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip >&2
  fi
  CONSTRAINTS="$VENV/rollout-fleet-constraints.txt"
  echo "$TORCH_PIN" > "$CONSTRAINTS"
}

log() { echo "[setup_${VENV_NAME}_env $(date +%H:%M:%S)] $*" >&2; }

venv_finish() {
  echo "$KEY" > "$STAMP"
  log "done: $VENV"
  echo "$PY"
}
