"""Child processes of the real-engine benchmarks and test tiers (bench/real_common.py,
tests/engines, tests/verl): each in its own process group (vLLM's server forks an engine core and
workers; a stop signals the whole group), logging to a file whose tail explains a failure, with
this checkout first on its path. Standard library and httpx only: the verl venv imports it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# Offline, CPU-sized: no hub downloads exist here, and vLLM's CPU KV cache defaults to gigabytes.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
STOP_S = 30.0  # SIGTERM, then this long before SIGKILL: vLLM's shutdown joins its engine core


def cache_dir() -> Path:
    """Where tiny models and cached venvs live (``$ROLLOUT_FLEET_CACHE``, default
    ``~/.cache/rollout-fleet``)."""
    path = Path(os.environ.get("ROLLOUT_FLEET_CACHE", str(Path.home() / ".cache" / "rollout-fleet")))
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(dev_mode: bool = False) -> dict[str, str]:
    """This environment with ``VLLM_ENV`` and this checkout first on the path (a venv's own install
    of the project may be another checkout's). ``dev_mode``: vLLM's development routes (weight
    reloads: /pause, /collective_rpc, /reset_prefix_cache, ...)."""
    env = {**os.environ, **VLLM_ENV}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@dataclass
class Child:
    """A subprocess in its own process group, with its log file (and its URL, for a server)."""

    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def tail(self, n: int = 120) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start(cmd: Sequence[str], log: Path, *, dev_mode: bool = False, url: str = "") -> Child:
    """``cmd`` started in the repository root, its output to ``log``."""
    with open(log, "wb") as handle:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT, env=child_env(dev_mode),
                                cwd=ROOT, start_new_session=True)
    return Child(proc, log, url)


def wait_http(child: Child, path: str, timeout_s: float) -> None:
    """Until ``GET path`` on the child's URL answers below 500; RuntimeError with the log's tail
    when the child exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.proc.args!r} exited with {child.proc.returncode}:\n{child.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(child.url + path, timeout=2.0).status_code < 500:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{child.url} not ready after {timeout_s}s:\n{child.tail()}")


def wait_exit(child: Child, timeout_s: float, what: str = "") -> None:
    """Until the child exits with 0; RuntimeError with the log's tail otherwise (stopped first when
    it outlives ``timeout_s``)."""
    name = what or repr(child.proc.args)
    try:
        child.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.stop()
        raise RuntimeError(f"{name} did not finish in {timeout_s}s:\n{child.tail()}") from None
    if child.proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({child.proc.returncode}):\n{child.tail()}")
