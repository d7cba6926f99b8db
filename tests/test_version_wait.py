"""A step whose min_policy_version no worker has announced waits a bounded time at the weight gate,
then fails with ``timeout`` (fallback: the trainer can retry); a close of the session and a drain
of the worker do not wait for it."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker import FleetClient
from schemas.errors import ErrorCode
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


async def test_a_version_never_announced_times_out_with_the_versions_named(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine(), version_wait_s=0.5)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    started = time.monotonic()
    r = await asyncio.wait_for(s.step(0, min_policy_version=99, **world_step(0)), 10)
    assert r.error and r.error.code is ErrorCode.TIMEOUT
    assert "policy version 99" in r.error.message and "version 0" in r.error.message
    assert 0.4 < time.monotonic() - started < 5
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id) == (-1, 0)  # the trainer can send step 0 again
    assert (await s.step(0, **world_step(0))).ok


async def test_closing_the_session_cancels_its_step_waiting_at_the_gate(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    w = await workers.add(NullEngine())  # the default wait: minutes
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    waiting = s.submit(0, min_policy_version=99, **world_step(0))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(s.close(), 5)
    r = await asyncio.wait_for(waiting, 5)
    assert r.error and r.error.code is ErrorCode.SESSION_CLOSED and "policy version 99" in r.error.message
    for _ in range(50):  # the lane finishes just after it answered
        if w.worker._active == 0:
            break
        await asyncio.sleep(0.05)
    assert w.worker._active == 0 and not w.worker._sessions  # capacity and lane are free


async def test_a_drain_does_not_wait_for_steps_blocked_at_the_gate(fleet: FleetClient, workers: WorkerPool) -> None:
    w = await workers.add(NullEngine(), drain_timeout_s=60)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    waiting = s.submit(0, min_policy_version=99, **world_step(0))
    await workers.add(NullEngine())  # room for the handover (a drain with none serves on: workers/drain.py)
    await asyncio.sleep(0.3)
    started = time.monotonic()
    await asyncio.wait_for(workers.stop(w), 10)
    assert time.monotonic() - started < 5
    r = await asyncio.wait_for(waiting, 5)
    assert r.error and r.error.code is ErrorCode.TIMEOUT and "draining" in r.error.message
