"""A fleet worker on real vLLM for the verl tier: the verl venv has verl but no vLLM and the engines
venv has vLLM but no verl, so the worker (``cli.main worker --engine vllm``) and vLLM's offline
anchor (``tests.engines.vllm_offline``) run as processes of the engines venv, on the tiny Llama that
the engines tier builds, and verl's agent loops run in this process, all on one private Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.children import ROOT, Child, cache_dir, child_env, start, wait_exit
from broker.ops.status import cell_status
from cli.processes import worker_command

MODEL_NAME = "tiny-llama"
ENGINE_OPTIONS = {"served_model_name": MODEL_NAME, "dtype": "float32", "max_model_len": 1024,
                  "enforce_eager": True}
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


def tiny_model(python: Path) -> str:
    """The engines tier's tiny Llama, made when missing (idempotent, seconds)."""
    path = cache_dir() / "tiny-llama"
    subprocess.run([str(python), str(ROOT / "scripts" / "make_tiny_model.py"), str(path)], check=True,
                   env=child_env(), capture_output=True, timeout=STARTUP_S)
    return str(path)


def offline_greedy(python: Path, model: str, conversations: list[list[dict[str, Any]]], logs: Path) -> Child:
    """vLLM's offline ``LLM.generate`` on ``conversations`` (tests/engines/vllm_offline.py's spec),
    started in the background: its answers land in ``logs / offline-out.json``."""
    spec = logs / "offline-spec.json"
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
    spec.write_text(json.dumps({"runs": [{"model": model, "engine": engine, "conversations": conversations}]}))
    return start([str(python), "-m", "tests.engines.vllm_offline", str(spec), str(logs / "offline-out.json")],
                 logs / "offline.log")


def wait_offline(child: Child) -> list[list[dict[str, Any]]]:
    wait_exit(child, STARTUP_S, "vLLM offline")
    [answers] = json.loads((child.log.parent / "offline-out.json").read_text())
    return list(answers)


def start_worker(python: Path, model: str, url: str, prefix: str, logs: Path) -> Child:
    """``cli.main worker --engine vllm`` in the engines venv, serving ``MODEL_NAME``."""
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
