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
from broker.redis.script_replies import Applied, Queued
from broker.redis.scripts import Scripts
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


async def test_malformed_entry_warnings_are_rate_limited(
    fleet: FleetClient, workers: WorkerPool, caplog: pytest.LogCaptureFixture
) -> None:
    """Broken entries (not fenced ones: a step id that is no number) by the dozen: each is still
    dead-lettered, but the log gets a few lines, the last of which counts what it left out."""
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    with caplog.at_level("WARNING", logger="workers"):
        for i in range(50):
            await fleet.redis.xadd(fleet.keys.inbox(w.id), {"kind": "step", "job_id": f"junk-{i}",
                                                             "session_id": s.session_id, "step_id": "zero"})
        assert await settled_inbox(fleet, w) == (0, 0)
        assert await fleet.redis.xlen(fleet.keys.dead) == 50  # every one is still accounted for
        assert (await s.step(0, **world_step(0))).ok  # the live session is untouched
    warnings = [r.getMessage() for r in caplog.records if "malformed job" in r.getMessage()]
    assert 1 <= len(warnings) <= 5, warnings


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


async def test_a_retried_reset_is_applied_once_and_the_next_reset_still_applies(scripts: Scripts) -> None:
    """A worker retries apply_control when Redis dropped its reply: the retry of a reset that went
    through must neither count as an unrequested reset nor use up the next one's pending count."""
    await scripts.register("w1", capacity=2, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full", result_window=1)
    first = await scripts.control("s1", "w1", kind="reset", job_id="r1", reply_to="c")
    second = await scripts.control("s1", "w1", kind="reset", job_id="r2", reply_to="c")
    assert isinstance(first, Queued) and isinstance(second, Queued)

    async def apply(entry_id: str) -> object:
        return await scripts.apply_control(session_id="s1", worker_id="w1", epoch=1, entry_id=entry_id, job_id="r",
                                           kind="reset", mode="tokens", model="m", reply_to="c", grace_ms=1000,
                                           reply_ttl_ms=1000)

    assert await apply(first.entry_id) == Applied(-1)
    assert await apply(first.entry_id) == Applied(-1)  # the retry changes nothing
    assert await scripts.redis.hget(scripts.keys.session("s1"), "reset_pending") == b"1"
    assert await apply(second.entry_id) == Applied(-1)
    assert await scripts.redis.hget(scripts.keys.session("s1"), "reset_pending") == b"0"
