"""A Redis that refuses writes (OOM, MISCONF, READONLY, NOREPLICAS, BUSY) and one that forgot its scripts
(NOSCRIPT): the trainer API answers instead of raising, nothing is half-written, a re-sent step
returns its stored result or runs, and the worker keeps its lease and counts the refusals.

Each test has its own redis-server: the refusals are made with its real configuration."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError

from broker import FleetClient
from broker.ops.failover import reap_exclusively, sessions_of
from broker.redis.connect import open_redis
from broker.redis.embedded import RedisServer, free_port, running_redis
from broker.redis.keys import CellKeys
from broker.redis.memory_policy import eviction_policy
from broker.redis.refusals import RedisRefused, Refusal
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode
from tests.support import FAST, WorkerPool, run_cli, until, worker_pool, world_step
from tests.test_gateway import SESSIONS, GatewayServer, body, create
from workers.engines.null import NullEngine, NullEngineConfig

RECONNECT_S = 1.0  # the client's window: a refusal longer than this answers redis_unavailable
BUSY_THRESHOLD_MS = 100  # busy-reply-threshold: a script running longer makes every command answer BUSY


@pytest.fixture
def server() -> Iterator[RedisServer]:
    extra = ["--enable-protected-configs", "yes", "--busy-reply-threshold", str(BUSY_THRESHOLD_MS)]
    with running_redis(extra_args=extra) as srv:
        yield srv


@pytest.fixture
async def admin(server: RedisServer) -> AsyncIterator[Redis]:
    redis = Redis.from_url(server.url)
    yield redis
    await redis.aclose()


@contextlib.asynccontextmanager
async def refusing(admin: Redis, server: RedisServer, reason: Refusal) -> AsyncIterator[None]:
    """Make the real server refuse writes for ``reason`` inside the block, and write again after it."""
    makers = {Refusal.OOM: _oom, Refusal.MISCONF: _misconf, Refusal.READONLY: _readonly,
              Refusal.NOREPLICAS: _noreplicas, Refusal.BUSY: _busy}
    async with makers[reason](admin, server):
        yield


@contextlib.asynccontextmanager
async def _oom(admin: Redis, server: RedisServer) -> AsyncIterator[None]:
    await admin.config_set("maxmemory-policy", "noeviction")
    await admin.config_set("maxmemory", 1)  # any write that can grow memory is refused
    try:
        yield
    finally:
        await admin.config_set("maxmemory", 0)


@contextlib.asynccontextmanager
async def _misconf(admin: Redis, server: RedisServer) -> AsyncIterator[None]:
    """An RDB save that fails (its directory cannot take files) with stop-writes-on-bgsave-error
    (which only stops writes while some save point is configured)."""
    home, save = (await admin.config_get("dir"))["dir"], (await admin.config_get("save"))["save"]
    await admin.config_set("save", "3600 1")
    await admin.config_set("stop-writes-on-bgsave-error", "yes")
    await admin.config_set("dir", "/proc")
    await admin.bgsave()
    await until(lambda: _bgsave_status(admin, "err"), "the failing BGSAVE did not fail", bound_s=30)
    try:
        yield
    finally:
        await admin.config_set("dir", home)
        await _bgsave_when_idle(admin)
        await until(lambda: _bgsave_status(admin, "ok"), "BGSAVE did not succeed again", bound_s=30)
        await admin.config_set("save", save)


async def _bgsave_status(admin: Redis, status: str) -> bool:
    info = await admin.info("persistence")
    return bool(info["rdb_last_bgsave_status"] == status and not info["rdb_bgsave_in_progress"])


async def _bgsave_when_idle(admin: Redis) -> None:
    for _ in range(100):
        with contextlib.suppress(ResponseError):  # a save still in progress
            await admin.bgsave()
            return
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _readonly(admin: Redis, server: RedisServer) -> AsyncIterator[None]:
    """A replica of a master that does not answer: it keeps its data and refuses writes."""
    await admin.replicaof("127.0.0.1", free_port())
    try:
        yield
    finally:
        await admin.replicaof("NO", "ONE")


@contextlib.asynccontextmanager
async def _noreplicas(admin: Redis, server: RedisServer) -> AsyncIterator[None]:
    """A master that must write to one replica at least, and has none."""
    await admin.config_set("min-replicas-to-write", 1)
    try:
        yield
    finally:
        await admin.config_set("min-replicas-to-write", 0)


@contextlib.asynccontextmanager
async def _busy(admin: Redis, server: RedisServer) -> AsyncIterator[None]:
    """A script that loops (writing nothing, so SCRIPT KILL ends it) on a connection of its own."""
    looping = Redis.from_url(server.url)
    task = asyncio.create_task(looping.eval("while true do end", 0))
    await until(lambda: _busy_now(admin), "the looping script did not make Redis busy", bound_s=30)
    try:
        yield
    finally:
        await until(lambda: _killed(admin), "SCRIPT KILL did not end the script", bound_s=30)
        with contextlib.suppress(ResponseError):
            await task
        await looping.aclose()


async def _busy_now(admin: Redis) -> bool:
    try:
        await admin.ping()
    except ResponseError as exc:
        return "BUSY" in str(exc) or type(exc).__name__ == "BusyScriptError"
    return False


async def _killed(admin: Redis) -> bool:
    with contextlib.suppress(ResponseError):  # NOTBUSY: it already ended
        await admin.script_kill()
    return not await _busy_now(admin)


async def _sessions(fleet: FleetClient) -> list[Any]:
    return [await fleet.create_session(model="null-world", mode="world_model_env"),
            await fleet.create_session(model="null-lm", mode="tokens")]


def _step(session: Any, i: int) -> dict[str, Any]:
    return world_step(i) if session.mode.value == "world_model_env" else {"token_ids": [1, 2, 3 + i]}


def _context(session: Any, i: int) -> int:
    """The null engine's context before step ``i``: steps run, or tokens held (3 ids in, 3 out a step)."""
    return i if session.mode.value == "world_model_env" else 6 * i


async def _epochs(admin: Redis, keys: CellKeys, sessions: list[Any]) -> list[Any]:
    return [await admin.hmget(keys.session(s.session_id), ["owner", "epoch"]) for s in sessions]


def _refusals(pool: WorkerPool, reason: Refusal) -> float:
    """``rollout_fleet_redis_refusals_total{reason}`` over the pool's workers."""
    return sum(running.worker.metrics.fleet.registry.get_sample_value(
        "rollout_fleet_redis_refusals_total", {"reason": reason.value}) or 0.0 for running in pool.running)


@pytest.mark.parametrize("reason", [Refusal.OOM, Refusal.MISCONF, Refusal.READONLY, Refusal.NOREPLICAS,
                                    Refusal.BUSY], ids=lambda r: r.value)
async def test_a_step_redis_refuses_answers_redis_unavailable_and_runs_once_it_writes_again(
        server: RedisServer, admin: Redis, prefix: str, reason: Refusal) -> None:
    lease_s = FAST["lease_ms"] / 1000.0
    async with worker_pool(server.url, prefix) as pool, \
            FleetClient(server.url, prefix=prefix, reconnect_s=RECONNECT_S) as fleet:
        await pool.add(NullEngine(), **FAST)
        await pool.add(NullEngine(), **FAST)  # somewhere the sessions could move to, were a lease lost
        sessions = await _sessions(fleet)
        for i in range(2):
            assert all(r.ok for r in await asyncio.gather(*(s.step(i, **_step(s, i)) for s in sessions)))
        before = await _epochs(admin, CellKeys(prefix), sessions)
        async with refusing(admin, server, reason):
            refused = await asyncio.gather(*(s.step(2, timeout=10.0, **_step(s, 2)) for s in sessions))
            await asyncio.sleep(3 * lease_s)  # longer than a lease: heartbeats are refused too
        for r in refused:
            assert not r.ok and r.error is not None
            assert r.error.code == ErrorCode.REDIS_UNAVAILABLE, r.error
            assert f"({reason.value})" in r.error.message, r.error.message
        await asyncio.sleep(3 * lease_s)  # a reaper that took the refusal for a dead worker would act now
        assert await _epochs(admin, CellKeys(prefix), sessions) == before  # every lease was kept
        for i in (2, 3):  # the step refused runs now, once, and the session goes on
            results = await asyncio.gather(*(s.step(i, **_step(s, i)) for s in sessions))
            assert [r.error for r in results if not r.ok] == []
            assert [r.output["context"] for r in results] == [_context(s, i) for s in sessions]
            assert not any(r.duplicate for r in results)
        assert _refusals(pool, reason) > 0  # counted (and logged once) by the workers


async def test_a_commit_redis_refuses_is_retried_and_a_resent_step_returns_its_stored_result(
        server: RedisServer, admin: Redis, prefix: str) -> None:
    """The step was queued before Redis refused writes and ran while it did: its commit waits, the
    trainer's wait ends in ``timeout``, and once Redis writes again the commit lands exactly once.
    A re-send while it waits gets that commit's result (not ``step_out_of_order``: the step is
    the trainer's own, in flight), and a re-send after it the stored result."""
    async with worker_pool(server.url, prefix) as pool, \
            FleetClient(server.url, prefix=prefix, reconnect_s=RECONNECT_S) as fleet:
        running = await pool.add(NullEngine(NullEngineConfig(delay_ms=1500)), **FAST)
        (session, _) = await _sessions(fleet)
        assert (await session.step(0, **world_step(0))).ok
        pending = session.submit(1, timeout=3.0, **world_step(1))
        await until(lambda: _running(running.worker), "step 1 did not reach the engine")
        async with refusing(admin, server, Refusal.OOM):
            first = await pending  # its commit is refused until the block ends
            assert not first.ok and first.error is not None and first.error.code == ErrorCode.TIMEOUT, first.error
            resent = session.submit(1, timeout=60.0, **world_step(1))
            await asyncio.sleep(0.5)
        waited = await resent
        assert waited.ok and waited.output["context"] == 1, waited.error
        assert (await session.status()).committed_step_id == 1
        again = await session.step(1, **world_step(1))
        assert again.ok and again.duplicate and again.output["context"] == 1, again.error
        nxt = await session.step(2, **world_step(2))
        assert nxt.ok and nxt.output["context"] == 2, nxt.error
        assert _refusals(pool, Refusal.OOM) > 0


async def _running(worker: Any) -> bool:
    return bool(worker.engine._running)


async def _committed(session: Any, step: int) -> bool:
    return bool((await session.status()).committed_step_id == step)


async def test_scripts_flushed_from_redis_are_loaded_again_without_the_trainer_seeing_it(
        server: RedisServer, admin: Redis, prefix: str) -> None:
    """SCRIPT FLUSH (or a restarted Redis) empties the script cache: EVALSHA answers NOSCRIPT, and
    both the plain call and a coalesced pipeline of calls load the script and run it."""
    async with worker_pool(server.url, prefix) as pool, FleetClient(server.url, prefix=prefix) as fleet:
        await pool.add(NullEngine(), **FAST)
        sessions = [s for _ in range(4) for s in await _sessions(fleet)]
        for i in range(3):
            await admin.script_flush()
            alone = await sessions[0].step(i, **_step(sessions[0], i))  # one call: the plain EVALSHA
            together = await asyncio.gather(*(s.step(i, **_step(s, i)) for s in sessions[1:]))  # one pipeline
            assert [r.error for r in (alone, *together) if not r.ok] == []
            assert [r.output["context"] for r in (alone, *together)] == [_context(s, i) for s in sessions]



@pytest.mark.parametrize("reason", [Refusal.OOM, Refusal.MISCONF, Refusal.READONLY, Refusal.NOREPLICAS],
                         ids=lambda r: r.value)
async def test_status_check_fails_with_the_reason_while_redis_refuses_writes(
        server: RedisServer, admin: Redis, prefix: str, reason: Refusal, capsys: pytest.CaptureFixture[str]) -> None:
    check = ["status", "--redis-url", server.url, "--prefix", prefix, "--check"]
    async with worker_pool(server.url, prefix) as pool:
        await pool.add(NullEngine(), **FAST)
        code, out, _ = await run_cli(capsys, *check)
        assert code == 0, out
        async with refusing(admin, server, reason):
            code, out, _ = await run_cli(capsys, *check)
            assert code == 1 and out.startswith(f"unhealthy: redis refuses writes ({reason.value}: "), out
            if reason is Refusal.OOM:
                assert "maxmemory" in out, out  # with the memory figures
        code, out, _ = await run_cli(capsys, *check)
        assert code == 0, out


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
async def test_an_evicting_policy_is_warned_at_start_up_and_fails_the_check(
        server: RedisServer, admin: Redis, prefix: str, policy: str, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    await admin.config_set("maxmemory-policy", policy)
    async with worker_pool(server.url, prefix) as pool:
        with caplog.at_level(logging.WARNING, logger="broker.redis.memory_policy"):
            await pool.add(NullEngine(), **FAST)
        assert f"maxmemory-policy is {policy}" in caplog.text
        code, out, _ = await run_cli(capsys, "status", "--redis-url", server.url, "--prefix", prefix, "--check")
        assert code == 1 and f"unhealthy: maxmemory-policy is {policy}" in out, out
        await admin.config_set("maxmemory-policy", "noeviction")
        code, out, _ = await run_cli(capsys, "status", "--redis-url", server.url, "--prefix", prefix, "--check")
        assert code == 0, out


@pytest.mark.parametrize("denied", ["config", "info"])
async def test_the_policy_is_read_where_the_acl_denies_config_or_info(
        server: RedisServer, admin: Redis, denied: str) -> None:
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    await admin.acl_setuser("fleet", enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", f"-{denied}"])
    redis = open_redis(server.url.replace("redis://", "redis://fleet:secret@"))
    try:
        with pytest.raises(NoPermissionError):
            await (redis.config_get("maxmemory-policy") if denied == "config" else redis.info("memory"))
        assert await eviction_policy(redis) == "allkeys-lru"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("reason", [Refusal.OOM, Refusal.MISCONF, Refusal.READONLY, Refusal.NOREPLICAS],
                         ids=lambda r: r.value)
async def test_a_refused_script_call_raises_its_reason_and_writes_nothing(
        server: RedisServer, admin: Redis, prefix: str, reason: Refusal) -> None:
    """enqueue.lua (the script of the issue's traceback) refused: RedisRefused with the reason,
    and the session hash, its log and the owner's inbox exactly as before."""
    keys = CellKeys(prefix)
    async with worker_pool(server.url, prefix) as pool, FleetClient(server.url, prefix=prefix) as fleet:
        await pool.add(NullEngine(), **FAST)
        session = await fleet.create_session(model="null-world", mode="world_model_env")
        assert (await session.step(0, **world_step(0))).ok
        scripts = Scripts(open_redis(server.url), keys)
        seen: list[Refusal] = []
        scripts.on_refusal = lambda refused: seen.append(refused.reason)

        async def state() -> tuple[Any, ...]:
            return (await admin.hgetall(keys.session(session.session_id)),
                    await admin.hgetall(keys.log(session.session_id)), await admin.xlen(keys.inbox(session.owner)))

        before = await state()
        try:
            async with refusing(admin, server, reason):
                with pytest.raises(RedisRefused) as refused:
                    await scripts.enqueue(session.session_id, session.owner, step_id=1, contextual=True,
                                          job_id="refused-job", reply_to="nobody", payload=b"\x80")
                assert refused.value.reason is reason and seen == [reason]
                assert await state() == before
        finally:
            await scripts.redis.aclose()


async def test_the_gateway_answers_503_with_the_reason_while_redis_refuses_writes(
        server: RedisServer, admin: Redis, prefix: str) -> None:
    async with worker_pool(server.url, prefix) as pool, \
            GatewayServer(server.url, prefix, model_default="null-world") as gateway, \
            httpx.AsyncClient(base_url=gateway.url, timeout=60.0) as http:
        await pool.add(NullEngine(), **FAST)
        sid = await create(http, model="null-world")
        async with refusing(admin, server, Refusal.OOM):
            refused = await http.post(SESSIONS, json={"model": "null-world"})
            assert refused.status_code == 503 and "(oom)" in refused.text, refused.text
        assert (await http.post(f"{SESSIONS}/{sid}/step", json=body(0))).json()["error"] is None
        await create(http, model="null-world")


async def test_no_lease_is_judged_until_a_lease_after_the_last_refusal(
        server: RedisServer, admin: Redis, prefix: str) -> None:
    """Heartbeats are writes: while Redis refuses them every lease runs out. A reaping pass that saw
    a refusal moves nobody's sessions until one lease after it; then a worker still silent (here:
    killed, its heartbeat long past) is failed over as usual."""
    lease_ms = 2000
    keys = CellKeys(prefix)
    async with worker_pool(server.url, prefix) as pool, FleetClient(server.url, prefix=prefix) as fleet:
        first = await pool.add(NullEngine(), reap=False, **FAST)
        session = await fleet.create_session(model="null-world", mode="world_model_env")
        await pool.add(NullEngine(), reap=False, **FAST)  # where the session can go
        await pool.kill(first)
        await admin.zadd(keys.workers, {first.id: 1})  # silent since long before any lease
        scripts = Scripts(open_redis(server.url), keys)
        try:
            async with refusing(admin, server, Refusal.OOM):
                with pytest.raises(RedisRefused):
                    await reap_exclusively(scripts, lease_ms=lease_ms)
            assert await reap_exclusively(scripts, lease_ms=lease_ms) is None  # held: nobody judged
            assert await sessions_of(scripts, first.id) == [session.session_id]
            await asyncio.sleep(lease_ms / 1000.0)
            await until(lambda: _reaped(scripts, lease_ms, first.id), "the silent worker was never failed over")
            assert await sessions_of(scripts, first.id) == []
        finally:
            await scripts.redis.aclose()


async def _reaped(scripts: Scripts, lease_ms: int, worker_id: str) -> bool:
    reports = await reap_exclusively(scripts, lease_ms=lease_ms)
    return any(r.worker_id == worker_id and r.moved for r in reports or [])
