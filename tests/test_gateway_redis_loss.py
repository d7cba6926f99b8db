"""The gateway across a Redis restarted without persistence: an HTTP step in flight comes back with
a clear error instead of hanging, and the same gateway process serves new sessions once Redis and a
worker are back (docs/durability.md: every component reconnects)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from broker.redis.embedded import RedisServer, free_port
from tests.support import worker_pool
from tests.test_gateway import SESSIONS, GatewayServer, body, create, step_error
from workers.engines.null import NullEngine, NullEngineConfig

pytestmark = pytest.mark.asyncio


async def _healthy(http: httpx.AsyncClient, attempts: int = 300) -> None:
    """Bounded: /health answers 200 once Redis answers and a worker registered again."""
    for _ in range(attempts):
        if (await http.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"/health never came back: {(await http.get('/health')).text}")


async def test_a_step_in_flight_when_redis_loses_its_data_ends_clearly_and_the_gateway_recovers(
    prefix: str,
) -> None:
    port = free_port()
    server = RedisServer(port=port).start()
    try:
        async with worker_pool(server.url, prefix) as pool, \
                GatewayServer(server.url, prefix, model_default="null-world", step_timeout=60.0) as gateway, \
                httpx.AsyncClient(base_url=gateway.url, timeout=120.0) as http:
            await pool.add(NullEngine(NullEngineConfig(delay_ms=1_500)), heartbeat_ms=200, lease_ms=2_000)
            sid = await create(http, model="null-world")
            step = asyncio.create_task(http.post(f"{SESSIONS}/{sid}/step", json=body(0)))
            await asyncio.sleep(0.3)  # the step is inside the engine's delay
            server.stop(kill=True)
            server.cleanup()
            server = RedisServer(port=port).start()  # back, empty
            lost = await asyncio.wait_for(step, 90)  # a 504 would mean the loss went unnoticed for 60 s
            assert lost.status_code == 404, lost.text
            step_error(lost, 404, "session_not_found")
            await _healthy(http)
            fresh = await create(http, model="null-world")
            done = await http.post(f"{SESSIONS}/{fresh}/step", json=body(0))
            assert done.status_code == 200 and done.json()["error"] is None, done.text
    finally:
        server.cleanup()


async def test_a_request_redis_does_not_answer_is_a_503_to_send_again_never_a_500(prefix: str) -> None:
    """A lookup the gateway makes before it can answer (the session's status here) meets a Redis
    that is gone: 503 with the reason and Retry-After, not an internal error."""
    server = RedisServer(port=free_port()).start()
    try:
        async with GatewayServer(server.url, prefix, model_default="null-world") as gateway, \
                httpx.AsyncClient(base_url=gateway.url, timeout=60.0) as http:
            server.stop(kill=True)
            r = await http.get(f"{SESSIONS}/s-1/status")
            assert r.status_code == 503, r.text
            assert "redis unreachable" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
    finally:
        server.cleanup()
