"""Heal by default: with nothing but workers started, a dead worker's sessions move; a trainer's
wait is bounded; a lost session or a lost inbox ends the wait or heals instead of hanging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from broker.redis.keys import INBOX_GROUP
from schemas.errors import ErrorCode, SessionNotFoundError
from tests.procs import Fleet
from tests.support import FAST, WorkerPool, world_step
from workers.engines.null import NullEngine, NullEngineConfig

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def quick_fleet(redis_server: RedisServer, prefix: str) -> AsyncIterator[FleetClient]:
    """A client whose waits are short enough for a test to watch them end."""
    async with FleetClient(redis_server.url, prefix=prefix, step_timeout=1.5, session_check_s=0.2) as client:
        yield client


async def test_a_killed_workers_sessions_move_with_no_supervisor(fleet: FleetClient, workers: WorkerPool) -> None:
    a = await workers.add(NullEngine(NullEngineConfig(delay_ms=50)), **FAST)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(4)]
    assert {s.owner for s in sessions} == {a.id}
    b = await workers.add(NullEngine(), **FAST)
    futs = [[s.submit(i, **world_step(i)) for i in range(5)] for s in sessions]
    await asyncio.sleep(0.1)  # a is inside the engine with a batch
    await workers.kill(a)  # nobody calls reap(): the surviving worker must
    for s, fs in zip(sessions, futs, strict=True):
        results = await asyncio.wait_for(asyncio.gather(*fs), 20)
        assert all(r.ok for r in results), [r.error for r in results]
        assert [r.output["context"] for r in results] == list(range(5))
        status = await s.status()
        assert status.committed_step_id == 4 and status.owner == b.id


async def test_the_client_bounds_a_step_by_default() -> None:
    assert FleetClient().step_timeout == 300.0
    with pytest.raises(ValueError, match="step_timeout"):
        FleetClient(step_timeout=0)


async def test_a_step_whose_worker_is_gone_times_out_and_is_not_lost(
    quick_fleet: FleetClient, workers: WorkerPool
) -> None:
    a = await workers.add(NullEngine(), **FAST)
    s = await quick_fleet.create_session(model="null-world", mode="world_model_env")
    await workers.kill(a)  # no other worker exists: the session cannot move
    r = await asyncio.wait_for(s.step(0, **world_step(0)), 10)  # no timeout given: the client's bound
    assert r.error is not None and r.error.code == ErrorCode.TIMEOUT, r.error
    assert "no result within 1.5s" in r.error.message  # ended by quick_fleet's step_timeout
    await workers.add(NullEngine(), **FAST)  # a worker appears; the queued step moves and commits
    deadline = time.monotonic() + 15
    while (await s.status()).committed_step_id < 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    again = await s.step(0, **world_step(0))  # re-sending the step returns its stored result
    assert again.ok and again.duplicate and again.output["context"] == 0


async def test_a_step_whose_session_vanished_fails_with_session_not_found(
    quick_fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine(NullEngineConfig(delay_ms=5000)), **FAST)
    s = await quick_fleet.create_session(model="null-world", mode="world_model_env")
    fut = s.submit(0, **world_step(0), timeout=30)
    await asyncio.sleep(0.3)
    await quick_fleet.redis.delete(quick_fleet.keys.session(s.session_id))  # as a Redis without persistence
    started = time.monotonic()
    r = await asyncio.wait_for(fut, 10)
    assert r.error is not None and r.error.code == ErrorCode.SESSION_NOT_FOUND, r.error
    assert time.monotonic() - started < 2.0
    with pytest.raises(SessionNotFoundError):
        await s.reset()


async def test_a_worker_whose_inbox_vanished_recreates_it_and_keeps_serving(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    a = await workers.add(NullEngine(), **FAST)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    await fleet.redis.delete(fleet.keys.inbox(a.id))  # stream and group gone; the worker is still registered
    r = await asyncio.wait_for(s.step(1, **world_step(1)), 15)
    assert r.ok and r.worker_id == a.id, r.error


@pytest.mark.slow
async def test_two_worker_processes_no_supervisor_sigkill_one_and_every_session_continues(
    redis_server: RedisServer, prefix: str
) -> None:
    procs = Fleet(redis_server.url, prefix)
    try:
        first = procs.worker("--engine-opt", "delay_ms=10")
        procs.worker("--engine-opt", "delay_ms=10")
        await procs.wait_active(2)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(8)]
            futs = [[s.submit(i, **world_step(i)) for i in range(30)] for s in sessions]
            await asyncio.sleep(0.3)
            first.kill()  # SIGKILL under load; no supervisor runs
            for s, fs in zip(sessions, futs, strict=True):
                results = await asyncio.wait_for(asyncio.gather(*fs), 60)
                assert all(r.ok for r in results), [r.error for r in results if not r.ok]
                assert [r.output["context"] for r in results] == list(range(30))
                assert (await s.status()).committed_step_id == 29
    finally:
        procs.close()


async def test_a_step_delivered_to_a_live_worker_but_never_received_runs_at_its_pending_check(
        fleet: FleetClient, workers: WorkerPool) -> None:
    """Redis can deliver inbox entries on a connection that fails before the reply arrives (a cluster
    client used to send the read again, for new entries only): they are pending for a live worker
    that never saw them. Made here the same way, by one read as the worker's consumer while its
    reader waits for room (one job in flight, a backlog of one)."""
    w = await workers.add(NullEngine(NullEngineConfig(delay_ms=1500)), max_inflight=1, read_count=1,
                          block_ms=200, pending_check_s=0.5)
    a, b, c = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(3)]
    first = asyncio.ensure_future(a.step(0, **world_step(0)))
    await asyncio.sleep(0.3)  # a's step runs in the engine: the one slot is taken
    second = asyncio.ensure_future(b.step(0, **world_step(0)))
    await asyncio.sleep(0.3)  # the reader took b's step into its backlog and waits for room
    third = asyncio.ensure_future(c.step(0, **world_step(0)))
    inbox = fleet.keys.inbox(w.id)

    async def c_queued() -> bool:
        return any(fields[b"session_id"] == c.session_id.encode() for _, fields in await fleet.redis.xrange(inbox))

    deadline = time.monotonic() + 1.0
    while not await c_queued():
        assert time.monotonic() < deadline, "c's step was not queued"
        await asyncio.sleep(0.01)
    stolen = await fleet.redis.xreadgroup(INBOX_GROUP, w.id, {inbox: ">"})
    assert [fields[b"session_id"] for _, fields in stolen[0][1]] == [c.session_id.encode()]  # the reader never got it
    results = await asyncio.wait_for(asyncio.gather(first, second, third), 15)
    assert [(r.ok, r.committed_step_id) for r in results] == [(True, 0)] * 3
