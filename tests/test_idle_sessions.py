"""Abandoned sessions do not hold worker capacity for ever: after its idle timeout a session is
closed through the ordinary close path (capacity and pool accounting stay right), and the
cell's status says how many were closed so."""

from __future__ import annotations

import asyncio

import pytest

from broker import FleetClient
from broker.ops.status import cell_status, format_status
from schemas.errors import CapacityExhaustedError, ErrorCode, InvalidRequestError
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


async def eventually_closed(fleet: FleetClient, session_id: str, timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if not await fleet.redis.hexists(fleet.keys.sessions, session_id):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_abandoned_sessions_are_closed_and_their_capacity_freed(
    fleet: FleetClient, workers: WorkerPool, redis_server, prefix: str  # type: ignore[no-untyped-def]
) -> None:
    w = await workers.add(NullEngine(), capacity=3, idle_sweep_s=0.1, heartbeat_ms=100)
    used = await fleet.create_session(model="null-world", mode="world_model_env", idle_timeout_s=0.5)
    assert (await used.step(0, **world_step(0))).ok
    never = await fleet.create_session(model="null-world", mode="world_model_env", idle_timeout_s=0.5)
    kept = await fleet.create_session(model="null-world", mode="world_model_env")  # the default: an hour
    with pytest.raises(CapacityExhaustedError):
        await fleet.create_session(model="null-world", mode="world_model_env")
    assert await eventually_closed(fleet, used.session_id) and await eventually_closed(fleet, never.session_id)
    assert (await used.status()).closed and not (await kept.status()).closed
    r = await used.step(1, **world_step(1))
    assert r.error and r.error.code is ErrorCode.SESSION_CLOSED
    assert float(await fleet.redis.zscore(fleet.keys.pool("world_model_env", "null-world"), w.id) or 0) == 1
    for _ in range(2):  # the capacity is free again
        await fleet.create_session(model="null-world", mode="world_model_env")
    await asyncio.sleep(0.3)  # the next heartbeat carries the count
    report = await cell_status(redis_server.url, prefix=prefix)
    assert report.workers[0].fields["idle_closed"] == "2"
    assert "idle_closed" in format_status(report).splitlines()[0]


async def test_a_session_in_use_is_not_idle(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), idle_sweep_s=0.05)
    s = await fleet.create_session(model="null-world", mode="world_model_env", idle_timeout_s=0.4)
    for i in range(8):  # 0.8 s of steps, each within the timeout of the last
        assert (await s.step(i, **world_step(i))).ok
        await asyncio.sleep(0.1)
    assert not (await s.status()).closed


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "60", True, 31 * 86400])
async def test_the_idle_timeout_is_validated(fleet: FleetClient, workers: WorkerPool, bad: object) -> None:
    await workers.add(NullEngine())
    with pytest.raises(InvalidRequestError, match="idle_timeout_s"):
        await fleet.create_session(model="null-world", mode="world_model_env", idle_timeout_s=bad)  # type: ignore[arg-type]
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0  # nothing created
