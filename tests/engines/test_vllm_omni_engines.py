"""The vLLM-Omni engines for real on CPU: vLLM-Omni's own rollout serving objects and HTTP server
(``ServingRLRollout`` / ``ServingRealtimeRobotOpenPI`` / its FastAPI router under uvicorn) around a
stand-in engine client that runs the reference world model. Through the fleet, every latent equals a
direct call of the vLLM-Omni serving layer with the same inputs."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from bench.world_standin import ReferenceWorldClient, build_serving
from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.errors import ContextLost, InvalidRequestError
from schemas.messages import WorldStep
from tests.engines.conftest import OMNI_MODEL, OMNI_SHAPE, Service, requires_vllm_omni
from tests.support import image, worker_pool
from workers.engines.base import Engine, EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig
from workers.engines.vllm_omni_engine import VLLMOmniEngine, VLLMOmniEngineConfig
from workers.engines.vllm_omni_http import VLLMOmniHTTPConfig, VLLMOmniHTTPEngine

pytestmark = [pytest.mark.engines, requires_vllm_omni]


def obs_step(i: int, seed: int = 0, prompt: str = "pick the cup", extra: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    """Keyword arguments of Session.step (a DROID-style world step); an explicit seed unless ``extra``
    is given (then the engines' default seed applies)."""
    if extra is None:
        extra = {"seed": 1000 + 10 * seed + i}
    return {
        "observation": {"prompt": prompt,
                        "images": {"observation/exterior_image_1_left": image(seed * 100 + i, 12, 16),
                                   "observation/wrist_image_left": image(seed * 100 + i + 50, 12, 16)},
                        "state": [0.02 * i] * 8, "extra": extra},
        "action": {"joint_positions": [0.1 * ((i + j + seed) % 5) for j in range(7)],
                   "gripper_position": [0.25 * (i % 3)]},
    }


def client(seed: int = 0) -> ReferenceWorldClient:
    return ReferenceWorldClient(OMNI_MODEL, latent_shape=OMNI_SHAPE, seed=seed)


def inproc_engine() -> VLLMOmniEngine:
    return VLLMOmniEngine(VLLMOmniEngineConfig(model=OMNI_MODEL), engine_client=client())


def http_engine(server: Service, **kw: Any) -> VLLMOmniHTTPEngine:
    return VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(base_url=server.url, model=OMNI_MODEL, **kw))


class Direct:
    """The vLLM-Omni serving layer called directly (no HTTP, no fleet): the anchor."""

    def __init__(self, weights_seed: int = 0) -> None:
        self.serving = build_serving(client(weights_seed))

    async def session(self) -> str:
        from vllm_omni.entrypoints.openai.protocol.rollout import CreateSessionRequest

        return str((await self.serving.create_session(CreateSessionRequest(model=OMNI_MODEL))).session_id)

    async def step(self, sid: str, step_id: int, kwargs: dict[str, Any], contextual: bool = True) -> np.ndarray:
        from vllm_omni.entrypoints.openai.protocol.rollout import RolloutStepRequest

        obs = kwargs["observation"]
        body = {"step_id": step_id, "use_session_context": contextual, "action": kwargs["action"],
                "observation": {**obs, "images": {k: v.tolist() for k, v in obs["images"].items()}}}
        answer = await self.serving.step(sid, RolloutStepRequest.model_validate(body))
        assert answer.error is None, answer.error
        out = answer.next_observation
        return np.frombuffer(base64.b64decode(out["video_latent"]), dtype=out["dtype"]).reshape(out["shape"])


async def fleet_run(url: str, engines: list[Engine], episodes: int, steps: int) -> list[list[Any]]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        for engine in engines:
            await pool.add(engine)
        sessions = [await fleet.create_session(model=OMNI_MODEL, mode="world_model_env") for _ in range(episodes)]

        async def run(k: int, s: Any) -> list[Any]:
            return [await s.step(i, **obs_step(i, seed=k)) for i in range(steps)]

        return await asyncio.gather(*(run(k, s) for k, s in enumerate(sessions)))


async def assert_equal_to_direct(results: list[list[Any]]) -> None:
    direct = Direct()
    for k, episode in enumerate(results):
        sid = await direct.session()
        for i, r in enumerate(episode):
            assert r.ok, (k, i, r.error)
            expected = await direct.step(sid, i, obs_step(i, seed=k))
            latent = r.output["video_latent"]
            assert latent.dtype == np.float32 and latent.shape == OMNI_SHAPE
            assert latent.tobytes() == expected.tobytes(), (k, i)
            assert r.context_length == i + 1


async def test_inprocess_engine_through_fleet_equals_the_serving_layer(redis_server: RedisServer) -> None:
    results = await fleet_run(redis_server.url, [inproc_engine(), inproc_engine()], episodes=4, steps=4)
    await assert_equal_to_direct(results)
    # latents depend on the history: the same inputs later in an episode give another latent
    assert results[0][0].output["video_latent"].tobytes() != results[1][0].output["video_latent"].tobytes()


async def test_http_engine_against_the_real_server_equals_the_serving_layer(
        redis_server: RedisServer, omni_server: Service) -> None:
    results = await fleet_run(redis_server.url, [http_engine(omni_server), http_engine(omni_server)],
                              episodes=4, steps=4)
    await assert_equal_to_direct(results)


@pytest.fixture(params=["inproc", "http"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    if request.param == "inproc":
        yield inproc_engine()
    else:
        yield http_engine(request.getfixturevalue("omni_server"))


async def test_reset_stateless_and_history(redis_server: RedisServer, engine: Engine) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        await pool.add(engine)
        s = await fleet.create_session(model=OMNI_MODEL, mode="world_model_env")
        first = await s.step(0, **obs_step(0, extra={}))  # the engine's default seed
        second = await s.step(1, **obs_step(0, extra={}))  # same inputs, later in the episode
        assert not np.array_equal(first.output["video_latent"], second.output["video_latent"])
        stateless = await s.step(9, use_session_context=False, **obs_step(0, extra={}))
        assert stateless.ok and np.array_equal(stateless.output["video_latent"], first.output["video_latent"])
        assert stateless.context_length == 1 and (await s.status()).committed_step_id == 1
        third = await s.step(2, **obs_step(2))
        assert third.ok and third.context_length == 3  # the stateless step changed nothing
        assert await s.reset() == -1
        again = await s.step(0, **obs_step(0, extra={}))
        assert np.array_equal(again.output["video_latent"], first.output["video_latent"])
        await s.close()


async def test_inference_error_retries_then_fails_without_moving_the_commit(
        redis_server: RedisServer, engine: Engine) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        await pool.add(engine, retry_backoff_ms=1.0)
        s = await fleet.create_session(model=OMNI_MODEL, mode="world_model_env")
        assert (await s.step(0, **obs_step(0))).ok
        failed = await s.step(1, **obs_step(1, prompt="fail"))  # the stand-in fails this prompt
        assert not failed.ok and failed.error.code.value == "inference_error" and failed.attempt == 3
        assert failed.committed_step_id == 0
        bad = await s.step(1, **obs_step(1, extra={"seed": -5}))  # the model rejects the seed
        assert not bad.ok and bad.error.code.value == "invalid_request" and bad.attempt == 1, bad
        ok = await s.step(1, **obs_step(1))
        assert ok.ok and ok.context_length == 2
        direct = Direct()
        sid = await direct.session()
        await direct.step(sid, 0, obs_step(0))
        assert ok.output["video_latent"].tobytes() == (await direct.step(sid, 1, obs_step(1))).tobytes()


class Flaky(httpx.AsyncBaseTransport):
    """Loses the answer of chosen step calls: before the server sees them, or after it ran them."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.drop_before = 0
        self.drop_after = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/step"):
            if self.drop_before:
                self.drop_before -= 1
                raise httpx.ConnectError("dropped before sending", request=request)
            if self.drop_after:
                self.drop_after -= 1
                response = await self.inner.handle_async_request(request)
                await response.aread()
                raise httpx.ReadTimeout("answer lost", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_http_lost_answers_use_status(omni_server: Service) -> None:
    flaky = Flaky()
    engine = VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(base_url=omni_server.url, model=OMNI_MODEL), transport=flaky)
    direct = Direct()
    sid = await direct.session()

    def req(i: int, reset: bool = False) -> EngineRequest:
        return EngineRequest("s", OMNI_MODEL, WorldStep.from_wire(obs_step(i)), reset=reset)

    async def run(i: int, reset: bool = False) -> Any:
        return (await engine.run_batch(OMNI_MODEL, [req(i, reset)]))[0]

    out = await run(0, reset=True)
    assert out.output["video_latent"].tobytes() == (await direct.step(sid, 0, obs_step(0))).tobytes()
    flaky.drop_before = 1  # never reached the server: /status says so, the retry runs it
    lost = await run(1)
    assert isinstance(lost, Exception) and not isinstance(lost, ContextLost), lost
    retry = await run(1)
    assert retry.output["video_latent"].tobytes() == (await direct.step(sid, 1, obs_step(1))).tobytes()
    server_sid = engine.server_session("s")
    flaky.drop_after = 1  # the server committed step 2 but its latent is gone: the context is lost
    assert isinstance(await run(2), ContextLost)
    assert isinstance(await run(2), ContextLost)  # until a rebuild starts from a reset step
    async with httpx.AsyncClient(base_url=omni_server.url) as http:
        await asyncio.sleep(0.2)
        status = (await http.get(f"/v1/realtime/sessions/{server_sid}/status")).json()
    assert status["closed"] is True  # the diverged server session was closed
    rebuilt = [await run(0, reset=True), await run(1), await run(2)]
    assert rebuilt[2].output["video_latent"].tobytes() == (await direct.step(sid, 2, obs_step(2))).tobytes()
    assert rebuilt[2].context_length == 3
    await engine.close()


async def test_http_drop_session_closes_the_server_session(omni_server: Service) -> None:
    engine = http_engine(omni_server)
    out = await engine.run_batch(OMNI_MODEL, [EngineRequest("k", OMNI_MODEL, WorldStep.from_wire(obs_step(0)),
                                                            reset=True)])
    assert not isinstance(out[0], BaseException)
    server_sid = engine.server_session("k")
    engine.drop_session("k")
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=omni_server.url) as http:
        status = (await http.get(f"/v1/realtime/sessions/{server_sid}/status")).json()
    assert status["closed"] is True and engine.server_session("k") is None
    await engine.close()


async def test_non_world_steps_are_invalid() -> None:
    from schemas.messages import TokenStep

    engine = inproc_engine()
    out = await engine.run_batch(OMNI_MODEL, [EngineRequest("k", OMNI_MODEL, TokenStep(token_ids=(1,)))])
    assert isinstance(out[0], InvalidRequestError)


@pytest.mark.parametrize("kind", ["inproc", "http"])
async def test_weight_updates_reload_the_world_model_through_its_engine_client(
        redis_server: RedisServer, kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Through the control stream: the engine client reloads (in process: ``collective_rpc``; over
    HTTP: the server's development routes around it); latents then equal the serving layer on the
    other weights, and a second update goes back (the shared server ends on its original weights)."""
    from broker.ops.weights import update_weights, workers_at_version

    paths = {}
    for seed in (0, 1):
        paths[seed] = str(tmp_path / f"world-{seed}.pt")
        ReferenceEngine(ReferenceEngineConfig(latent_shape=OMNI_SHAPE, seed=seed)).save_weights(paths[seed])
    engine = inproc_engine() if kind == "inproc" else http_engine(request.getfixturevalue("omni_server"))
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(redis_server.url, prefix) as pool, FleetClient(redis_server.url, prefix=prefix) as fleet:
        w = await pool.add(engine)
        episodes: dict[int, list[Any]] = {}
        for version, seed in ((0, 0), (1, 1), (2, 0)):
            if version:
                await update_weights(fleet.redis, fleet.keys, model=OMNI_MODEL, version=version, path=paths[seed])
                await workers_at_version(fleet.redis, fleet.keys, model=OMNI_MODEL, version=version, timeout=60)
                assert not await fleet.redis.hget(fleet.keys.worker(w.id), "weights_error")
            s = await fleet.create_session(model=OMNI_MODEL, mode="world_model_env")
            episodes[version] = [await s.step(i, **obs_step(i)) for i in range(2)]
    for version, seed in ((0, 0), (1, 1), (2, 0)):
        direct = Direct(weights_seed=seed)
        sid = await direct.session()
        for i, r in enumerate(episodes[version]):
            assert r.ok and r.policy_version == version, (version, i, r.error)
            expected = await direct.step(sid, i, obs_step(i))
            assert r.output["video_latent"].tobytes() == expected.tobytes(), (version, i)
    assert episodes[1][0].output["video_latent"].tobytes() != episodes[0][0].output["video_latent"].tobytes()


async def test_a_weight_update_the_engine_client_cannot_do_is_reported(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A stage without ``reload_weights`` (vLLM-Omni answers ``{"todo": ...}``): the worker says so in
    its heartbeat and keeps serving the old weights."""

    class NoReload(ReferenceWorldClient):
        async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
            return [{"todo": f"{method} is not implemented for diffusion stages"}]

    engine = VLLMOmniEngine(VLLMOmniEngineConfig(model=OMNI_MODEL),
                            engine_client=NoReload(OMNI_MODEL, latent_shape=OMNI_SHAPE))
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(redis_server.url, prefix) as pool, FleetClient(redis_server.url, prefix=prefix) as fleet:
        from broker.ops.weights import update_weights

        w = await pool.add(engine)
        await update_weights(fleet.redis, fleet.keys, model=OMNI_MODEL, version=1, path=str(tmp_path / "x.pt"))
        error = b""
        for _ in range(200):
            error = await fleet.redis.hget(fleet.keys.worker(w.id), "weights_error") or b""
            if error:
                break
            await asyncio.sleep(0.05)
        assert b"todo" in error and b"version 1" in error, error
        s = await fleet.create_session(model=OMNI_MODEL, mode="world_model_env")
        r = await s.step(0, **obs_step(0))
        assert r.ok and r.policy_version == 0
