"""Engine readiness: a worker whose engine is not ready says so (registry hash, status, the
rollout_fleet_engine_ready gauge), takes no new session, keeps the ones it has, and takes new
ones again once ready; the HTTP engines probe their server's /health."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from broker import FleetClient
from broker.ops.metrics import FleetMetrics
from broker.ops.status import cell_status, format_status
from broker.ops.weights import update_weights, workers_at_version
from broker.redis.connect import open_redis
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts
from schemas.errors import CapacityExhaustedError
from tests.support import FAST, WorkerPool, until, world_step
from workers.engines.null import NullEngine
from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine
from workers.engines.vllm_omni_http import VLLMOmniHTTPConfig, VLLMOmniHTTPEngine
from workers.readiness import Readiness

WORLD = "null-world"


class SwitchedEngine(NullEngine):
    """The null engine with a readiness switch: False, or an exception to raise, means not ready."""

    def __init__(self) -> None:
        super().__init__()
        self.answer: bool | Exception = True

    async def ready(self) -> bool:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def worker_field(scripts: Scripts, worker_id: str, name: str) -> str:
    raw = await scripts.redis.hget(scripts.keys.worker(worker_id), name)
    return raw.decode() if raw is not None else ""


async def test_a_worker_whose_engine_is_not_ready_takes_no_new_session(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts, redis_server: RedisServer, prefix: str) -> None:
    switched = SwitchedEngine()
    flaky = await workers.add(switched, heartbeat_ms=FAST["heartbeat_ms"], metrics_port=0)
    kept = await fleet.create_session(model=WORLD, mode="world_model_env")
    assert (await kept.step(0, **world_step(0))).ok
    # Its drain below finds no capacity elsewhere: it serves on only this long (workers/drain.py).
    steady = await workers.add(NullEngine(), heartbeat_ms=FAST["heartbeat_ms"], drain_timeout_s=0.5)

    switched.answer = ConnectionError("vLLM server at :8001 refused the connection")

    async def says_not_ready() -> bool:
        return await worker_field(scripts, flaky.id, "engine_ready") == "0"
    await until(says_not_ready, "the worker never said its engine is not ready", 10.0)
    assert "refused the connection" in await worker_field(scripts, flaky.id, "engine_reason")
    assert flaky.worker.metrics.fleet.registry.get_sample_value("rollout_fleet_engine_ready") == 0
    table = format_status(await cell_status(redis_server.url, prefix=prefix))
    assert "NO (ConnectionError: vLLM server at :8001 refused the connection)" in table

    # New sessions all go to the ready worker, though the other one is the less loaded.
    owners = {(await fleet.create_session(model=WORLD, mode="world_model_env")).owner for _ in range(4)}
    assert owners == {steady.id}
    assert (await kept.step(1, **world_step(1))).ok  # its sessions stay and keep running

    await workers.stop(steady)  # alone and not ready: no capacity anywhere
    with pytest.raises(CapacityExhaustedError):
        await fleet.create_session(model=WORLD, mode="world_model_env")

    switched.answer = True

    async def takes_sessions() -> bool:
        try:
            return (await fleet.create_session(model=WORLD, mode="world_model_env")).owner == flaky.id
        except CapacityExhaustedError:
            return False
    await until(takes_sessions, "the worker did not take sessions again once ready", 10.0)
    assert await worker_field(scripts, flaky.id, "engine_ready") == "1"
    assert flaky.worker.metrics.fleet.registry.get_sample_value("rollout_fleet_engine_ready") == 1


class ReloadingEngine(SwitchedEngine):
    """Answers its health check with an error while it loads weights, as a vLLM server busy with a
    reload can (its /health times out)."""

    async def load_model_weights(self, model: str, path: str, version: int) -> None:
        self.answer = TimeoutError("health check timed out")
        await asyncio.sleep(0.6)  # a dozen probes at this heartbeat
        await super().load_model_weights(model, path, version)
        self.answer = True


async def test_a_weight_update_does_not_make_the_worker_refuse_sessions(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    """The worker's own reload is not an engine failure: capacity stays offered throughout, and a
    session created as soon as the worker reports the new version is placed (no capacity_exhausted)."""
    w = await workers.add(ReloadingEngine(), heartbeat_ms=50)
    update = asyncio.create_task(update_weights(fleet.redis, fleet.keys, model=WORLD, version=1, path="/w1"))
    seen: set[str] = set()
    reached = asyncio.create_task(workers_at_version(fleet.redis, fleet.keys, model=WORLD, version=1, timeout=10))
    while not reached.done():
        seen.add(await worker_field(scripts, w.id, "engine_ready"))
        await asyncio.sleep(0.02)
    await update
    await reached
    assert seen == {"1"} and w.worker.readiness.ready
    assert (await fleet.create_session(model=WORLD, mode="world_model_env")).owner == w.id


async def test_a_worker_not_ready_at_start_registers_without_capacity(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    switched = SwitchedEngine()
    switched.answer = False
    w = await workers.add(switched, heartbeat_ms=FAST["heartbeat_ms"])
    assert await worker_field(scripts, w.id, "engine_ready") == "0"
    assert await worker_field(scripts, w.id, "engine_reason") == "the engine reports it is not ready"
    with pytest.raises(CapacityExhaustedError):
        await fleet.create_session(model=WORLD, mode="world_model_env")


@pytest.mark.parametrize("make", [
    lambda t: VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://vllm", model="m"), transport=t),
    lambda t: VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(base_url="http://vllm", model="m"), transport=t),
], ids=["vllm-http", "vllm-omni-http"])
async def test_the_http_engines_probe_their_servers_health(make: Any) -> None:
    status = {"code": 503}
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(status["code"])

    engine = make(httpx.MockTransport(answer))
    try:
        with pytest.raises(RuntimeError, match=r"http://vllm/health answered HTTP 503"):
            await engine.ready()
        status["code"] = 200
        assert await engine.ready() is True
        assert seen == ["/health", "/health"]
    finally:
        await engine.close()


async def test_an_http_engine_without_its_server_is_not_ready() -> None:
    engine = VLLMHTTPEngine(VLLMHTTPConfig(base_url="http://127.0.0.1:9", model="m", connect_timeout_s=1.0))
    try:
        with pytest.raises(httpx.ConnectError):
            await engine.ready()
    finally:
        await engine.close()


class CancelledAsReady(NullEngine):
    """Ready at once, and cancels ``victim`` in the same turn: the cancel lands while the probe's
    awaitable has finished and the probe has not yet resumed."""

    def __init__(self) -> None:
        super().__init__()
        self.victim: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        if self.victim is not None:
            asyncio.get_running_loop().call_soon(self.victim.cancel)
        return True


async def test_a_readiness_loop_cancelled_as_the_engine_answers_still_stops(redis_server: RedisServer,
                                                                           prefix: str) -> None:
    """A worker's shutdown cancels its readiness loop and waits for it. With the probe bounded by
    asyncio.wait_for (Python 3.11) a cancel arriving in the turn the engine answered was swallowed:
    the loop probed on, and the shutdown waited for ever (a teardown hang seen under load)."""
    engine = CancelledAsReady()
    readiness = Readiness(engine, capacity=1, metrics=FleetMetrics())
    redis = open_redis(redis_server.url)
    try:
        loop = asyncio.create_task(readiness.follow(Scripts(redis, CellKeys(prefix)), lambda: "w-ready", 10))
        engine.victim = loop
        done, _ = await asyncio.wait({loop}, timeout=5.0)
        if not done:  # stop it the plain way, so that a failure does not hang the test run
            engine.victim = None
            loop.cancel()
            await asyncio.wait({loop}, timeout=5.0)
        assert done and loop.cancelled(), "the readiness loop swallowed its cancel"
    finally:
        await redis.aclose()
