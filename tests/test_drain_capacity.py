"""A drain that finds no capacity elsewhere keeps serving and says so; a session nobody can take
answers capacity_exhausted instead of leaving its trainer to wait out the step timeout."""

from __future__ import annotations

import asyncio
import logging

import pytest

from broker import FleetClient
from broker.ops.failover import reap
from broker.ops.status import cell_status, format_status
from broker.redis.embedded import RedisServer
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode
from tests.support import FAST, WorkerPool, reap_until_moved, until, world_step
from workers.engines.null import NullEngine

WORLD = {"model": "null-world", "mode": "world_model_env"}


async def test_a_drain_without_capacity_elsewhere_serves_on_and_hands_over_once_a_worker_joins(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts, redis_server: RedisServer, prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="workers.drain")
    a = await workers.add(NullEngine(), **FAST, drain_timeout_s=60.0)
    sessions = [await fleet.create_session(**WORLD) for _ in range(2)]
    for s in sessions:
        assert (await s.step(0, **world_step(0))).ok
    a.worker.request_stop()

    async def says_stuck() -> bool:
        return await scripts.redis.hget(scripts.keys.worker(a.id), "drain_stuck") == b"2"
    await until(says_stuck, "the draining worker never said its sessions are stuck", 15.0)
    assert "2 sessions found no live worker with free capacity" in caplog.text
    assert a.worker.metrics.fleet.registry.get_sample_value("rollout_fleet_drain_stuck_sessions") == 2
    report = await cell_status(redis_server.url, prefix=prefix)
    [entry] = [w.as_json(FAST["lease_ms"]) for w in report.workers]
    assert (entry["state"], entry["drain_stuck"]) == ("draining", 2)
    assert "draining: 2 sessions found no live worker with free capacity" in format_status(report, FAST["lease_ms"])

    served = await sessions[0].step(1, **world_step(1))  # still served while it waits for room
    assert served.ok and served.worker_id == a.id and served.output["context"] == 1

    b = await workers.add(NullEngine(), **FAST)
    await asyncio.wait_for(asyncio.shield(a.task), 15)  # the drain ends once b has taken them
    after = await sessions[0].step(2, **world_step(2))
    assert after.ok and after.worker_id == b.id and after.output["context"] == 2  # context rebuilt on b
    assert (await sessions[1].step(1, **world_step(1))).ok
    assert a.worker.metrics.fleet.registry.get_sample_value("rollout_fleet_drain_stuck_sessions") == 0
    await workers.stop(a)


async def _full_worker(fleet: FleetClient, workers: WorkerPool) -> None:
    """A live worker of the same pool with no room: the fleet is up, and full."""
    full = await workers.add(NullEngine(), **FAST, capacity=1)
    assert (await fleet.create_session(**WORLD)).owner == full.id


async def test_after_the_drain_timeout_a_waiting_step_answers_capacity_exhausted(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts,
) -> None:
    a = await workers.add(NullEngine(), **FAST, drain_timeout_s=0.3)
    s = await fleet.create_session(**WORLD)
    assert (await s.step(0, **world_step(0))).ok
    await _full_worker(fleet, workers)
    await workers.stop(a)  # nobody has room: the session stays, marked unplaced
    assert await scripts.redis.hget(scripts.keys.session(s.session_id), "unplaced_ms") is not None

    # The client waits up to its step timeout (300 s); the mark answers within session_check_s.
    r = await asyncio.wait_for(s.step(1, **world_step(1)), 30)
    assert not r.ok and r.error is not None and r.error.code is ErrorCode.CAPACITY_EXHAUSTED
    assert r.committed_step_id == 0

    b = await workers.add(NullEngine(), **FAST)
    await reap_until_moved(scripts, a.id)  # a's lease expired; b has room now

    async def committed() -> bool:  # step 1 stayed queued and ran on b
        return (await s.status()).committed_step_id == 1
    await until(committed, "the queued step never ran on the new owner", 15.0)
    again = await s.step(1, **world_step(1))
    assert again.ok and again.duplicate and again.output["context"] == 1 and again.worker_id == b.id


async def test_a_dead_workers_session_with_nowhere_to_go_answers_capacity_exhausted(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts,
) -> None:
    a = await workers.add(NullEngine(), **FAST)
    s = await fleet.create_session(**WORLD)
    assert (await s.step(0, **world_step(0))).ok
    await _full_worker(fleet, workers)
    await workers.kill(a)
    step = asyncio.create_task(s.step(1, **world_step(1)))

    async def reaper() -> None:  # the supervisor's passes (the full worker reaps too)
        while True:
            await reap(scripts, lease_ms=FAST["lease_ms"])
            await asyncio.sleep(0.1)
    passes = asyncio.create_task(reaper())
    try:
        r = await asyncio.wait_for(step, 30)
    finally:
        passes.cancel()
    assert not r.ok and r.error is not None and r.error.code is ErrorCode.CAPACITY_EXHAUSTED


async def test_with_no_live_worker_at_all_a_dead_workers_session_is_not_marked(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts,
) -> None:
    """Every worker gone (a fleet restarting, replacements on their way) is a delay, not a full
    fleet: the session waits unmarked, and the trainer's step waits for its bound."""
    a = await workers.add(NullEngine(), **FAST)
    s = await fleet.create_session(**WORLD)
    await workers.kill(a)
    await scripts.redis.zadd(scripts.keys.workers, {a.id: 0})  # its lease ran out long ago
    report = await reap(scripts, lease_ms=FAST["lease_ms"])
    assert [(r.stuck, r.full) for r in report] == [([s.session_id], [])]
    assert await scripts.redis.hget(scripts.keys.session(s.session_id), "unplaced_ms") is None
