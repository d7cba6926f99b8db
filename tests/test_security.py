"""The trust model, run: every component under the documented minimal ACL user, and over TLS with
a certificate authority made for the test (docs/security.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

from broker import FleetClient
from broker.client.fleet import DEFAULT_SESSION_CHECK_S, DEFAULT_STEP_TIMEOUT_S
from broker.gateway.errors import MAX_ERROR_CHARS, MAX_INPUT_CHARS, MAX_REPORTED_ERRORS
from broker.gateway.settings import GatewaySettings
from broker.ops.acl import fleet_acl_rules
from broker.ops.arq_queue import MAX_ARQ_JOB_BYTES
from broker.ops.status import cell_status
from broker.ops.supervisor import SupervisorSettings, build_worker, request_replay
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from broker.redis.keys import MAX_NAME_LENGTH
from broker.redis.layouts import (
    DEAD_LETTER_MAXLEN,
    DEAD_LETTER_PAYLOAD_BYTES,
    DEFAULT_IDLE_TIMEOUT_S,
    MAX_IDLE_TIMEOUT_S,
)
from cli.replay import run_replay_command
from tests.support import FAST, WorkerPool, stop_supervisor, worker_pool, world_step
from tests.test_gateway import SESSIONS, GatewayServer, body
from tests.tls import TlsRedis, make_certificates, tls_redis_server
from workers.engines.null import NullEngine
from workers.settings import WorkerSettings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "security.md"


@pytest.fixture
async def acl_url(redis_server: RedisServer, prefix: str) -> AsyncIterator[str]:
    """A user made from ``fleet_acl_rules`` (and nothing else) on the test server; its URL."""
    password = "s3cret-pass"
    async with _admin(redis_server) as admin:
        await admin.execute_command("ACL", "SETUSER", _user(prefix), "on", f">{password}", *fleet_acl_rules(prefix))
        yield f"redis://{_user(prefix)}:{password}@127.0.0.1:{redis_server.port}/0"
        await admin.acl_deluser(_user(prefix))


def _user(prefix: str) -> str:
    return f"fleet-{prefix}"


@contextlib.asynccontextmanager
async def _admin(redis_server: RedisServer) -> AsyncIterator[Redis]:
    admin = Redis.from_url(redis_server.url)
    try:
        yield admin
    finally:
        await admin.aclose()


async def _refusals(redis_server: RedisServer, prefix: str) -> list[str]:
    """What Redis refused the fleet's user (ACL LOG): command or key names."""
    async with _admin(redis_server) as admin:
        return [f"{e['reason']} {e['object']}" for e in await admin.acl_log() if e.get("username") == _user(prefix)]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    try:
        server = tls_redis_server(make_certificates(tmp_path_factory.mktemp("tls")))
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS support: {exc}")
        raise
    yield server
    server.server.cleanup()


async def _run_supervisor_until(settings: SupervisorSettings, done: Any, timeout: float = 15.0) -> None:
    supervisor = build_worker(settings, handle_signals=False)
    task = asyncio.create_task(supervisor.async_run())
    try:
        deadline = time.monotonic() + timeout
        while not await done():
            assert not task.done(), f"the supervisor stopped: {task.exception()}"
            assert time.monotonic() < deadline, "the supervisor did not get there in time"
            await asyncio.sleep(0.05)
    finally:
        await stop_supervisor(supervisor, task)


async def _fail_over_and_replay(url: str, prefix: str, pool: WorkerPool) -> None:
    """Client, workers and supervisor on ``url``: a step, a worker killed and reaped, the next step
    on the new owner, then a replay request run by the supervisor."""
    settings = SupervisorSettings(CellConfig(redis_url=url, prefix=prefix, lease_ms=FAST["lease_ms"]))
    async with FleetClient(url, prefix=prefix) as fleet:
        first = await pool.add(NullEngine(), **FAST)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        assert (await s.step(0, **world_step(0))).ok
        second = await pool.add(NullEngine(), **FAST)
        await pool.kill(first)
        step = asyncio.create_task(s.step(1, **world_step(1)))
        await _run_supervisor_until(settings, lambda: asyncio.sleep(0, step.done()))
        result = await step
        assert result.ok and result.worker_id == second.id and (await s.status()).epoch == 2

        job_id = await request_replay(settings, {"session": s.session_id}, dry_run=True)
        arq = Redis.from_url(url)
        try:
            await _run_supervisor_until(settings, lambda: arq.exists(f"arq:result:{job_id}"))
        finally:
            await arq.aclose()


async def test_every_component_runs_under_the_documented_minimal_acl(
    redis_server: RedisServer, acl_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with worker_pool(acl_url, prefix) as pool:
        await _fail_over_and_replay(acl_url, prefix, pool)  # worker, client, supervisor, replay job
        report = await cell_status(acl_url, prefix=prefix)
        assert len(report.workers) >= 1 and report.live_sessions == 1
        replay_args = argparse.Namespace(action="list", session=None, code=None, older_than=None,
                                         newer_than=None, limit=100, json=False, ids=[], dry_run=False)
        assert await run_replay_command(CellConfig(redis_url=acl_url, prefix=prefix), replay_args) == 0
        assert "0 dead-lettered jobs" in capsys.readouterr().out
        # With a key, so that its per-key session count (<prefix>:gateway:open:*) runs under the user too.
        keyed = GatewaySettings(api_keys=frozenset({"acl-key"}))
        async with GatewayServer(acl_url, prefix, settings=keyed) as gateway, \
                httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": "Bearer acl-key"},
                                  timeout=30.0) as http:
            created = await http.post(SESSIONS, json={"model": "null-world"})
            assert created.status_code == 200, created.text
            sid = created.json()["session_id"]
            stepped = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
            assert stepped.status_code == 200 and stepped.json()["error"] is None, stepped.text
            status = await http.get(f"{SESSIONS}/{sid}/status")
            assert status.status_code == 200, status.text
            assert (await http.post(f"{SESSIONS}/{sid}/close")).status_code == 200
    assert await _refusals(redis_server, prefix) == []  # nothing any component sent was denied


async def test_the_acl_keeps_the_fleet_user_to_its_own_keys_and_commands(
    redis_server: RedisServer, acl_url: str, prefix: str
) -> None:
    redis = Redis.from_url(acl_url)
    try:
        await redis.set(f"{prefix}:{{0}}:probe", 1)
        for forbidden in (redis.set("someone-else:key", 1), redis.flushdb(), redis.keys("*"),
                          redis.config_get("dir"), redis.publish("news", "x")):
            with pytest.raises(NoPermissionError):
                await forbidden
    finally:
        await redis.aclose()
    assert sorted(await _refusals(redis_server, prefix)) == [
        "command config|get", "command flushdb", "command keys", "command publish", "key someone-else:key"]


def test_the_acl_refuses_a_prefix_that_would_widen_it() -> None:
    for prefix in ("rf*", "r?", "[rf]", "rf:x", ""):
        with pytest.raises(ValueError):
            fleet_acl_rules(prefix)


def test_docs_show_the_acl_the_code_builds() -> None:
    shown = re.findall(r"^ACL SETUSER fleet on >\S+ (.+)$", DOCS.read_text(), flags=re.MULTILINE)
    assert shown == [" ".join(fleet_acl_rules("rf"))]


def _documented_defaults() -> dict[str, str]:
    """The "other bounds" table of docs/security.md: bound -> its default column."""
    table = DOCS.read_text().split("The other bounds", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].lstrip("| "): cells[1] for cells in rows[1:]}


def test_docs_state_the_defaults_the_code_has() -> None:
    mib, kib = 1024 * 1024, 1024
    dead_payloads = DEAD_LETTER_MAXLEN * DEAD_LETTER_PAYLOAD_BYTES // mib
    gateway, worker = GatewaySettings(), WorkerSettings()
    expected = {
        "gateway request body": f"{gateway.max_body_bytes // mib} MiB ({gateway.max_body_bytes:,} bytes)",
        "gateway open sessions per key": f"{gateway.max_sessions_per_key}",
        "gateway step wait": f"{gateway.step_timeout_s:.0f} s",
        "client step / reset wait": f"{DEFAULT_STEP_TIMEOUT_S:.0f} s",
        "session idle timeout": f"{DEFAULT_IDLE_TIMEOUT_S:.0f} s, at most {MAX_IDLE_TIMEOUT_S / 86400:.0f} days",
        "wait for `min_policy_version`": f"{worker.version_wait_s:.0f} s",
        "dead letters": f"a payload kept up to {DEAD_LETTER_PAYLOAD_BYTES // kib} KiB, {DEAD_LETTER_MAXLEN:,} letters "
                        f"({dead_payloads} MiB of payloads, about 130 MiB in all)",
        "reply stream of a reader that left": f"{worker.reply_stream_bytes // mib} MiB; a result of "
                                              f"{worker.large_reply_bytes // mib} MiB or more sets a "
                                              f"{worker.large_reply_ttl_ms // 60_000} min TTL (else "
                                              f"{worker.reply_ttl_ms // 3_600_000} h)",
        "arq job": f"{MAX_ARQ_JOB_BYTES // mib} MiB",
        "gateway malformed-body answer": f"{MAX_REPORTED_ERRORS} errors named, each input cut to {MAX_INPUT_CHARS} "
                                         f"characters, each error to {MAX_ERROR_CHARS}",
        "results stream, consumer group, session id": f"{MAX_NAME_LENGTH} characters, without braces, colons, "
                                                      "spaces or control characters",
    }
    documented = _documented_defaults()
    assert {bound: documented.get(bound) for bound in expected} == expected
    text = DOCS.read_text()
    assert f"decodes run in {gateway.decode_threads} threads" in text
    assert f"every {DEFAULT_SESSION_CHECK_S:.0f} s" in text


async def test_tls_with_the_ca_in_the_url_reaches_every_component(tls_redis: TlsRedis, prefix: str) -> None:
    url = tls_redis.url()
    async with worker_pool(url, prefix) as pool:
        await _fail_over_and_replay(url, prefix, pool)
    assert (await cell_status(url, prefix=prefix)).live_sessions == 1


async def test_tls_without_the_ca_is_refused(tls_redis: TlsRedis) -> None:
    redis = Redis.from_url(tls_redis.url(with_ca=False))
    try:
        with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await redis.ping()
    finally:
        await redis.aclose()
