"""The gateway's API keys: 401 without one, a session bound to the key that created it (403 for
another), a per-key cap on open sessions (429), /health open to probes, and the CLI's key flags
and default model."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest

from broker import FleetClient
from broker.gateway.settings import GatewaySettings
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer, running_redis
from cli.args import build_parser, gateway_settings
from tests.support import FAST, WorkerPool, cli_http_server
from tests.test_gateway import SESSIONS, GatewayServer, body, error_body
from tests.test_gateway_limits import MB, post_raw
from tests.test_multiturn import reference_engine
from workers.engines.null import NullEngine

ALPHA, BETA = {"Authorization": "Bearer alpha-key"}, {"Authorization": "Bearer beta-key"}


@pytest.fixture
async def keyed(redis_server: RedisServer, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(api_keys=frozenset({"alpha-key", "beta-key"}), max_sessions_per_key=2)
    # /health sees a killed worker go within seconds; the lease stays well above a loaded heartbeat.
    fast_lease = CellConfig(lease_ms=4 * FAST["lease_ms"])
    async with GatewayServer(redis_server.url, prefix, settings=settings, config=fast_lease) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
        yield client


async def create_as(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    r = await http.post(SESSIONS, json={"model": "reference-world"}, headers=headers)
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


async def test_every_route_but_health_needs_a_known_key(keyed: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine(), heartbeat_ms=FAST["heartbeat_ms"])
    sid = await create_as(keyed, ALPHA)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "alpha-key"},
                    {"Authorization": "Basic alpha-key"}):
        for method, path, json in (("POST", SESSIONS, {"model": "reference-world"}),
                                   ("POST", f"{SESSIONS}/{sid}/step", body(0)),
                                   ("POST", f"{SESSIONS}/{sid}/reset", None), ("POST", f"{SESSIONS}/{sid}/close", None),
                                   ("GET", f"{SESSIONS}/{sid}/status", None), ("GET", "/openapi.json", None),
                                   ("GET", "/docs", None)):
            r = await keyed.request(method, path, json=json, headers=headers)
            assert error_body(r, 401)["message"].startswith("missing or unknown API key"), (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
    assert (await keyed.get("/health")).status_code == 200
    port = int(str(keyed.base_url).rstrip("/").rsplit(":", 1)[1])
    code, _, sent = await asyncio.to_thread(post_raw, port, f"{SESSIONS}/{sid}/step", 200 * MB, declare=True)
    assert code == 401 and sent < 32 * MB  # no key, no body read
    status = await keyed.get(f"{SESSIONS}/{sid}/status", headers=ALPHA)
    assert status.json()["committed_step_id"] == -1 and status.json()["closed"] is False


async def test_a_session_answers_only_the_key_that_created_it(keyed: httpx.AsyncClient, workers: WorkerPool,
                                                               fleet: FleetClient) -> None:
    await workers.add(reference_engine())
    sid = await create_as(keyed, ALPHA)
    for method, path, json in (("POST", "step", body(0)), ("POST", "reset", None), ("POST", "close", None),
                               ("GET", "status", None)):
        r = await keyed.request(method, f"{SESSIONS}/{sid}/{path}", json=json, headers=BETA)
        assert error_body(r, 403)["message"] == f"Session {sid!r} belongs to another API key."
    status = await fleet.status(sid)  # nothing the other key sent changed the session
    assert status.committed_step_id == -1 and not status.closed and status.next_step_id == 0
    assert (await keyed.post(f"{SESSIONS}/{sid}/step", json=body(0), headers=ALPHA)).status_code == 200
    assert (await keyed.post(f"{SESSIONS}/{sid}/close", headers=ALPHA)).json()["closed"] is True
    assert (await keyed.post(f"{SESSIONS}/{sid}/close", headers=ALPHA)).json()["closed"] is True
    assert error_body(await keyed.post(f"{SESSIONS}/{sid}/close", headers=BETA), 403)
    assert error_body(await keyed.get(f"{SESSIONS}/missing/status", headers=BETA), 404)
    stored = await fleet.redis.hgetall(fleet.keys.session(sid))
    assert hashlib.sha256(b"alpha-key").hexdigest().encode() in stored.values()
    assert not any(b"alpha-key" in value for value in stored.values())  # the key itself is never stored


async def test_open_sessions_per_key_are_capped(keyed: httpx.AsyncClient, workers: WorkerPool,
                                                fleet: FleetClient) -> None:
    await workers.add(reference_engine(), capacity=16)
    first, _second = await create_as(keyed, ALPHA), await create_as(keyed, ALPHA)
    refused = await keyed.post(SESSIONS, json={"model": "reference-world"}, headers=ALPHA)
    assert "2 open sessions" in error_body(refused, 429)["message"]
    assert len(await fleet.redis.keys(fleet.keys.session("*"))) == 2  # the refused create left nothing
    await create_as(keyed, BETA)  # another key has its own cap
    assert (await keyed.post(f"{SESSIONS}/{first}/close", headers=ALPHA)).status_code == 200
    await create_as(keyed, ALPHA)  # a closed session no longer counts


async def test_health_needs_redis_and_a_live_worker(keyed: httpx.AsyncClient, workers: WorkerPool) -> None:
    down = await keyed.get("/health")
    assert "no live worker serves model 'reference-world'" in error_body(down, 503)["message"]
    running = await workers.add(reference_engine(), heartbeat_ms=FAST["heartbeat_ms"])
    up = await keyed.get("/health")
    assert up.status_code == 200 and up.json() == {"status": "ok", "model": "reference-world", "live_workers": 1}
    await workers.stop(running)
    for _ in range(100):  # the worker left its pools (and its heartbeat ages past the lease)
        if (await keyed.get("/health")).status_code == 503:
            break
        await asyncio.sleep(0.1)
    assert (await keyed.get("/health")).status_code == 503


async def test_health_answers_503_in_bounded_time_when_redis_is_gone(prefix: str) -> None:
    with running_redis() as private:
        async with GatewayServer(private.url, prefix) as server, \
                httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
            private.stop(kill=True)
            gone = await asyncio.wait_for(http.get("/health"), 10)  # a hang fails here, not at httpx's 30 s
            assert "redis does not answer" in error_body(gone, 503)["message"]


def test_cli_keys_from_flags_or_the_variable() -> None:
    env = {"ROLLOUT_FLEET_API_KEY": "env-a, env-b"}
    from_env = gateway_settings(build_parser(env).parse_args(["gateway"]))
    assert from_env.api_keys == {"env-a", "env-b"}
    flags = ["gateway", "--api-key", "a", "--api-key", "b,c", "--max-sessions-per-key", "3", "--step-timeout", "5"]
    given = gateway_settings(build_parser(env).parse_args(flags))
    assert given.api_keys == {"a", "b", "c"} and given.max_sessions_per_key == 3 and given.step_timeout_s == 5.0
    default = gateway_settings(build_parser({}).parse_args(["gateway"]))
    assert default.api_keys == frozenset() and default.step_timeout_s == 60.0
    assert "env-a" not in build_parser(env).format_help() and "env-a" not in repr(from_env)


async def test_the_gateway_verbs_default_model_is_the_one_health_needs(
        redis_server: RedisServer, prefix: str, fleet: FleetClient, workers: WorkerPool) -> None:
    """`gateway --model` (or its variable): /health is 200 once a live worker serves it, not only
    when one serves reference-world; a create names its model, as upstream's does."""
    await workers.add(NullEngine())
    env = {"ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix,
           "ROLLOUT_FLEET_MODEL": "null-world"}
    async with cli_http_server(["gateway"], env, "/health", lambda r: r.status_code == 200) as http:
        assert (await http.get("/health")).json()["model"] == "null-world"
        unnamed = await http.post(SESSIONS, json={})
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "body.model", unnamed.text
        created = await http.post(SESSIONS, json={"model": "null-world"})
        assert created.status_code == 200, created.text
    assert (await fleet.attach(created.json()["session_id"])).model == "null-world"
