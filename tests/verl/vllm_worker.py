"""A fleet worker on real vLLM for the verl tier: the verl venv has verl but no vLLM and the engines
venv has vLLM but no verl, so the worker (``workers.cli worker --engine vllm``) and vLLM's offline
anchor (``tests.engines.vllm_offline``) run as processes of the engines venv, on the tiny Llama that
the engines tier builds, and verl's agent loops run in this process, all on one private Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker.ops.status import cell_status
from workers.processes import worker_command

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-llama"
ENGINE_OPTIONS = {"served_model_name": MODEL_NAME, "dtype": "float32", "max_model_len": 1024,
                  "enforce_eager": True}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
STARTUP_S = float(os.environ.get("ROLLOUT_FLEET_ENGINE_STARTUP_S", "300"))
BUILD_HINT = "scripts/setup_engines_env.sh (or scripts/run_engine_tests.sh, which CI runs before this tier)"


def engines_python() -> Path:
    """The engines venv's python (``$ROLLOUT_FLEET_ENGINES_VENV``, default
    ``~/.cache/rollout-fleet/engines-venv``); a missing venv fails the test with the command that
    builds it (the tier's vLLM half cannot run without it, and a skip would hide that)."""
    venv = Path(os.environ.get("ROLLOUT_FLEET_ENGINES_VENV",
                               str(Path.home() / ".cache" / "rollout-fleet" / "engines-venv")))
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the engines venv (vLLM) is missing at {venv}: build it with {BUILD_HINT}", pytrace=False)
    return python


def cache_dir() -> Path:
    """Where the engines tier keeps its tiny models (``$ROLLOUT_FLEET_CACHE``, as tests/engines)."""
    path = Path(os.environ.get("ROLLOUT_FLEET_CACHE", str(Path.home() / ".cache" / "rollout-fleet")))
    path.mkdir(parents=True, exist_ok=True)
    return path


def child_env() -> dict[str, str]:
    """This checkout first on the path: the engines venv's own install of the project may be another's."""
    env = {**os.environ, **VLLM_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def tiny_model(python: Path) -> str:
    """The engines tier's tiny Llama, made when missing (idempotent, seconds)."""
    path = cache_dir() / "tiny-llama"
    subprocess.run([str(python), str(ROOT / "scripts" / "make_tiny_model.py"), str(path)], check=True,
                   env=child_env(), capture_output=True, timeout=STARTUP_S)
    return str(path)


@dataclass
class Child:
    """A subprocess in its own process group, with its log."""

    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start(cmd: Sequence[str], log: Path) -> Child:
    with open(log, "wb") as handle:
        proc = subprocess.Popen(list(cmd), stdout=handle, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                                start_new_session=True)
    return Child(proc, log)


def offline_greedy(python: Path, model: str, conversations: list[list[dict[str, Any]]], logs: Path) -> Child:
    """vLLM's offline ``LLM.generate`` on ``conversations`` (tests/engines/vllm_offline.py's spec),
    started in the background: its answers land in ``logs / offline-out.json``."""
    spec = logs / "offline-spec.json"
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
    spec.write_text(json.dumps({"runs": [{"model": model, "engine": engine, "conversations": conversations}]}))
    return start([str(python), "-m", "tests.engines.vllm_offline", str(spec), str(logs / "offline-out.json")],
                 logs / "offline.log")


def wait_offline(child: Child) -> list[list[dict[str, Any]]]:
    try:
        child.proc.wait(timeout=STARTUP_S)
    except subprocess.TimeoutExpired:
        child.stop()
        raise RuntimeError(f"vLLM offline did not finish in {STARTUP_S}s:\n{child.tail()}") from None
    if child.proc.returncode != 0:
        raise RuntimeError(f"vLLM offline failed ({child.proc.returncode}):\n{child.tail()}")
    [answers] = json.loads((child.log.parent / "offline-out.json").read_text())
    return list(answers)


def start_worker(python: Path, model: str, url: str, prefix: str, logs: Path) -> Child:
    """``workers.cli worker --engine vllm`` in the engines venv, serving ``MODEL_NAME``."""
    cmd = worker_command(url, prefix, engine="vllm", log_level="INFO",
                         engine_options={"model": model, **ENGINE_OPTIONS})
    return start([str(python), *cmd[1:]], logs / "vllm-worker.log")


async def wait_worker_active(child: Child, url: str, prefix: str) -> None:
    """Until the worker process reports itself active (its engine started) in the cell."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"the vLLM worker exited with {child.proc.returncode}:\n{child.tail()}")
        report = await cell_status(url, prefix=prefix)
        if any(w.fields.get("state") == "active" for w in report.workers):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the vLLM worker was not active after {STARTUP_S}s:\n{child.tail()}")


@contextlib.contextmanager
def stopped_at_exit(*children: Child) -> Iterator[None]:
    try:
        yield
    finally:
        for child in children:
            child.stop()
