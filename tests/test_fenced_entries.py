"""Inbox entries the session hash fences off (a foreign or stale epoch) are acknowledged and dropped
without touching the live session: no context drop, no rebuild, no state change."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from broker import FleetClient
from broker.client.session import Session
from broker.redis.keys import INBOX_GROUP
from schemas.codec import encode
from tests.support import RunningWorker, WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


def forged(s: Session, *, kind: str, epoch: int, step_id: int, payload: bytes = b"") -> dict[str, Any]:
    """An inbox entry in the layout enqueue.lua writes, stamped with an epoch of our choosing."""
    return {"kind": kind, "job_id": f"forged-{kind}-{epoch}", "session_id": s.session_id, "step_id": step_id,
            "contextual": "1", "epoch": epoch, "gen": 0, "mode": "world_model_env", "model": "null-world",
            "reply_to": "nobody", "enqueued_ms": int(time.time() * 1000), "attempt": 0, "payload": payload}


async def settled_inbox(fleet: FleetClient, w: RunningWorker, timeout: float = 5.0) -> tuple[int, int]:
    """(pending, length) of the worker's inbox once nothing is pending or the timeout passed."""
    inbox = fleet.keys.inbox(w.id)
    deadline = time.monotonic() + timeout
    while True:
        pending = (await fleet.redis.xpending(inbox, INBOX_GROUP))["pending"]
        if (pending == 0 and w.worker._active == 0) or time.monotonic() > deadline:
            return pending, await fleet.redis.xlen(inbox)
        await asyncio.sleep(0.05)


async def run_steps(fleet: FleetClient, w: RunningWorker, forge: dict[str, Any] | None) -> bytes:
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    assert (await s.step(1, **world_step(1))).ok
    if forge is not None:
        await fleet.redis.xadd(fleet.keys.inbox(w.id), forged(s, **forge))
        assert await settled_inbox(fleet, w) == (0, 0)  # acknowledged and dropped
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id, st.epoch) == (1, 2, 1)  # nothing moved
    r = await s.step(2, **world_step(2))
    assert r.ok, r.error
    return bytes(r.output["video_latent"].tobytes()) + str(r.output["context"]).encode()


async def test_a_foreign_epoch_step_is_acked_and_the_session_runs_on_without_a_rebuild(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    w = await workers.add(NullEngine())
    clean = await run_steps(fleet, w, None)
    payload = encode(world_step(2))
    with_forged = await run_steps(fleet, w, {"kind": "step", "epoch": 7, "step_id": 2, "payload": payload})
    assert with_forged == clean
    assert w.worker.executor.rebuilt_steps == 0  # the live context was never dropped


async def test_a_forged_reset_with_a_stale_epoch_changes_nothing(fleet: FleetClient, workers: WorkerPool) -> None:
    w = await workers.add(NullEngine())
    clean = await run_steps(fleet, w, None)
    assert await run_steps(fleet, w, {"kind": "reset", "epoch": 0, "step_id": -1}) == clean
    assert w.worker.executor.rebuilt_steps == 0


async def test_fenced_entry_warnings_are_rate_limited(
    fleet: FleetClient, workers: WorkerPool, caplog: pytest.LogCaptureFixture
) -> None:
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    with caplog.at_level("WARNING", logger="workers"):
        for epoch in range(10, 60):
            await fleet.redis.xadd(fleet.keys.inbox(w.id), forged(s, kind="reset", epoch=epoch, step_id=-1))
        assert await settled_inbox(fleet, w) == (0, 0)
    warnings = [r for r in caplog.records if "fenced" in r.getMessage()]
    assert 1 <= len(warnings) <= 5


async def test_a_forged_reset_at_the_live_epoch_cannot_desynchronise_the_session(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    """A reset that control.lua never enqueued (no reset pending) is fenced off like a stale one:
    applied, it would move committed to -1 while next_step_id stays, and every later step would
    be out of order."""
    w = await workers.add(NullEngine())
    clean = await run_steps(fleet, w, None)
    assert await run_steps(fleet, w, {"kind": "reset", "epoch": 1, "step_id": -1}) == clean
    assert w.worker.executor.rebuilt_steps == 0
