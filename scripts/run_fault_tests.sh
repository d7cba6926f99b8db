#!/usr/bin/env bash
# The network-fault tier: half-open partitions between separate hosts made of network namespaces
# on this machine (bench/netns.py), each component cut off Redis in turn (tests/faults/).
#
#   scripts/run_fault_tests.sh [pytest args...]     (PYTHON=... picks the interpreter; default .venv)
#
# Needs root (ip netns, veth, iptables inside the namespaces), iproute2 and iptables (installed
# with apt-get when missing). It touches no address outside 10.201.0.0/24 and no host-wide
# setting; every namespace it made is removed at the end, and at the next start after a crash.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$(id -u)" != 0 ]; then
  echo "the fault tier needs root (network namespaces, veth pairs, iptables); run it as root or in CI" >&2
  exit 1
fi
if ! command -v ip >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1; then
  echo "ip or iptables not on PATH: installing iproute2 and iptables" >&2
  apt-get update -qq && apt-get install -y -qq iproute2 iptables >/dev/null
fi
PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the worker processes in the namespaces import this checkout
exec "$PY" -m pytest -q -m faults -p no:cacheprovider tests/faults "$@"
