"""Durable commits on a master + replica pair (``redis-server --replicaof``): with
``durability="replicated"`` a step's reply goes out only once the replica has its commit; the
default (``async``) answers at once. The replica is paused with SIGSTOP: the master still counts it
as connected, so only a WAIT on the commit's own connection can tell that it lacks the commit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from broker import FleetClient
from broker.redis.embedded import RedisServer
from broker.redis.keys import INBOX_GROUP, CellKeys
from broker.redis.layouts import log_result_field
from schemas.errors import ErrorCode
from tests.support import RunningWorker, equals, until, worker_pool, world_step
from workers.engines.null import NullEngine

BOUND_S = 30.0  # every wait of these tests ends by then (a loaded machine included)


@dataclass
class Pair:
    master: RedisServer
    replica: RedisServer


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    master = RedisServer(extra_args=["--repl-diskless-sync-delay", "0"]).start()  # no 5 s wait for the first sync
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)]).start()
    try:
        yield Pair(master, replica)
    finally:
        replica.cleanup()
        master.cleanup()


@pytest.fixture
async def master(pair: Pair) -> AsyncIterator[Redis]:
    redis = Redis.from_url(pair.master.url, decode_responses=True)
    await until(lambda: replica_online(redis), "the replica to sync", BOUND_S, 0.02)
    yield redis
    await redis.aclose()


async def replica_online(redis: Redis) -> bool:
    """Synced and streaming: before that WAIT counts it for nobody, whichever connection asks."""
    replica = (await redis.info("replication")).get("slave0")
    return isinstance(replica, dict) and replica.get("state") == "online"


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """SIGSTOP: the process stops acknowledging replication, its connection stays open."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


async def session_field(redis: Redis, keys: CellKeys, session_id: str, name: str) -> str | None:
    value = await redis.hget(keys.session(session_id), name)
    return None if value is None else str(value)


async def pending(redis: Redis, keys: CellKeys, worker: RunningWorker) -> int:
    return int((await redis.xpending(keys.inbox(worker.id), INBOX_GROUP))["pending"])


async def test_a_replicated_step_is_answered_only_once_the_replica_has_it(pair: Pair, master: Redis,
                                                                          prefix: str) -> None:
    keys = CellKeys(prefix)
    replica = Redis.from_url(pair.replica.url, decode_responses=True)
    async with worker_pool(pair.master.url, prefix) as pool, FleetClient(pair.master.url, prefix=prefix) as fleet:
        worker = await pool.add(NullEngine(), durability="replicated", durability_timeout_s=BOUND_S)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        first = await asyncio.wait_for(s.step(0, **world_step(0)), BOUND_S)
        assert first.ok
        # the reply came after the replica acknowledged the commit: the replica holds it now
        assert await replica.hget(keys.session(s.session_id), "committed_step_id") == "0"
        with paused(pair.replica):
            step = s.submit(1, **world_step(1))
            await until(lambda: equals(session_field(master, keys, s.session_id, "committed_step_id"), "1"),
                        "step 1 to be written on the master", BOUND_S, 0.02)
            # written, but neither acknowledged nor answered: the job stays pending, marked unconfirmed
            assert await pending(master, keys, worker) == 1
            assert await session_field(master, keys, s.session_id, "unconfirmed_step") == "1"
            assert not step.done()
            # a re-send is queued for the owner instead of being answered from the unconfirmed result
            again = s.submit(1, **world_step(1))
            await until(lambda: equals(master.xlen(keys.inbox(worker.id)), 2), "the re-sent step to be queued",
                        BOUND_S, 0.02)
            assert not again.done()
        results = await asyncio.wait_for(asyncio.gather(step, again), BOUND_S)
        assert [(r.ok, r.committed_step_id, r.output["context"]) for r in results] == [(True, 1, 1)] * 2
        assert await session_field(master, keys, s.session_id, "unconfirmed_step") is None
        assert await pending(master, keys, worker) == 0
        assert await replica.hget(keys.session(s.session_id), "committed_step_id") == "1"
    await replica.aclose()


async def test_without_a_replica_past_the_bound_the_step_answers_timeout_never_committed(
        pair: Pair, master: Redis, prefix: str) -> None:
    keys = CellKeys(prefix)
    async with worker_pool(pair.master.url, prefix) as pool, FleetClient(pair.master.url, prefix=prefix) as fleet:
        await pool.add(NullEngine(), durability="replicated", durability_timeout_s=1.0)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        with paused(pair.replica):
            result = await asyncio.wait_for(s.step(0, **world_step(0)), BOUND_S)
            assert not result.ok and result.error is not None
            assert result.error.code is ErrorCode.TIMEOUT
            assert "not reported as committed" in result.error.message
            # the master holds the commit, marked as unconfirmed, so no re-send reads it meanwhile
            assert await session_field(master, keys, s.session_id, "unconfirmed_step") == "0"
        again = await asyncio.wait_for(s.step(0, **world_step(0)), BOUND_S)  # the replica is back
        assert again.ok and again.committed_step_id == 0 and again.output["context"] == 0
        nxt = await asyncio.wait_for(s.step(1, **world_step(1)), BOUND_S)
        assert nxt.ok and nxt.output["context"] == 1
        assert await session_field(master, keys, s.session_id, "unconfirmed_step") is None


async def test_the_async_default_answers_before_the_replica_has_the_commit(pair: Pair, master: Redis,
                                                                          prefix: str) -> None:
    async with worker_pool(pair.master.url, prefix) as pool, FleetClient(pair.master.url, prefix=prefix) as fleet:
        await pool.add(NullEngine())
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        with paused(pair.replica):
            result = await asyncio.wait_for(s.step(0, **world_step(0)), BOUND_S)
            assert result.ok  # answered "committed" ...
            info = await master.info("replication")
            # ... while the replica has acknowledged less than the master wrote: the risk it takes
            assert int(info["slave0"]["offset"]) < int(info["master_repl_offset"])


async def test_a_commit_redis_lost_is_answered_out_of_order_and_the_trainer_can_send_it_again(
        redis_server: RedisServer, prefix: str) -> None:
    """A failover before a replica had a commit (or a restart without persistence) leaves Redis
    behind the worker. A job for that step used to reach the duplicate path, whose re-publish
    call committed its empty result as the step; now it answers step_out_of_order with the
    fallback, and the re-sent step runs again on the rebuilt context. A later step whose commit
    finds Redis behind answers the same way (it used to keep next_step_id, so no re-send fit)."""
    keys = CellKeys(prefix)
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    async with worker_pool(redis_server.url, prefix) as pool, FleetClient(redis_server.url, prefix=prefix) as fleet:
        await pool.add(NullEngine())
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        for i in range(2):
            assert (await asyncio.wait_for(s.step(i, **world_step(i)), BOUND_S)).ok
        # what the promoted replica holds when step 1's commit never reached it
        await redis.hset(keys.session(s.session_id), mapping={"committed_step_id": 0, "next_step_id": 1})
        await redis.hdel(keys.log(s.session_id), log_result_field(1, 1), "input:1")
        lost = await asyncio.wait_for(s.step(1, **world_step(1)), BOUND_S)
        assert not lost.ok and lost.error is not None and lost.error.code is ErrorCode.STEP_OUT_OF_ORDER
        assert "commit was lost" in lost.error.message
        assert await redis.hget(keys.session(s.session_id), "committed_step_id") == "0"  # nothing empty committed
        again = await asyncio.wait_for(s.step(1, **world_step(1)), BOUND_S)
        assert again.ok and again.output["context"] == 1  # rebuilt from step 0, then step 1 once
        assert (await asyncio.wait_for(s.step(2, **world_step(2)), BOUND_S)).output["context"] == 2
        # lost again, and the trainer's next step is the one after it: the commit finds Redis behind
        await redis.hset(keys.session(s.session_id), "committed_step_id", 1)
        await redis.hdel(keys.log(s.session_id), log_result_field(2, 1), "input:2")
        behind = await asyncio.wait_for(s.step(3, **world_step(3)), BOUND_S)
        assert not behind.ok and behind.error is not None and behind.error.code is ErrorCode.STEP_OUT_OF_ORDER
        assert behind.committed_step_id == 1 and "send the steps again from 2" in behind.error.message
        results = [await asyncio.wait_for(s.step(i, **world_step(i)), BOUND_S) for i in (2, 3)]
        assert [(r.ok, r.output["context"]) for r in results] == [(True, 2), (True, 3)]
    await redis.aclose()
