"""Large step payloads outside Lua arguments (broker/redis/inputs.py): staged by the trainer, moved
by enqueue.lua and commit.lua, read by the worker with one GET, and never left behind."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import FleetClient
from broker.ops.replay import list_dead, replay
from broker.redis.blobs import STAGE_BYTES, unless_unstaged
from broker.redis.inputs import STAGED
from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import DEAD_LETTER_PAYLOAD_BYTES
from broker.redis.script_replies import (
    Committed,
    Created,
    Duplicate,
    Forked,
    Published,
    Queued,
    Refused,
    StaleOwner,
)
from broker.redis.scripts import CommitCall, Scripts, lua_source
from schemas.errors import ErrorCode
from tests.support import FAST, WorkerPool, image, reap_until_moved, world_step
from tests.test_replay import BreakableEngine
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

pytestmark = pytest.mark.asyncio


def big(step: int, size: int = STAGE_BYTES + 500) -> bytes:
    return bytes([step % 251]) * (size + step)


def large_step(i: int) -> dict[str, Any]:
    """A world step whose observation (a 128x128 image) is staged: over STAGE_BYTES once encoded."""
    step = world_step(i)
    step["observation"]["images"] = {"observation/exterior_image_1_left": image(i, h=128, w=128)}
    return step


async def _session(scripts: Scripts, *, retention: str = "full", sid: str = "s1") -> None:
    await scripts.register("w1", capacity=8, pools=[scripts.keys.pool("world_model_env", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    assert await scripts.create(sid, "world_model_env", "m", lease_ms=5000, retention=retention,
                                result_window=2) == Created("w1")


async def _enqueue(scripts: Scripts, step: int, payload: bytes, *, job: str | None = None, owner: str = "w1",
                   sid: str = "s1") -> object:
    return await scripts.enqueue(sid, owner, step_id=step, contextual=True, job_id=job or f"j{step}",
                                 reply_to="c", payload=payload)


async def _entry_payload(scripts: Scripts, worker: str = "w1") -> bytes:
    [(_, fields)] = (await scripts.redis.xrange(scripts.keys.inbox(worker)))[-1:]
    payload: bytes = fields[b"payload"]
    return payload


async def _commit(scripts: Scripts, step: int, *, keep: int = -1, worker: str = "w1", epoch: int = 1,
                  job: str | None = None, record: bytes = b"record") -> object:
    return await scripts.commit(CommitCall(session_id="s1", worker_id=worker, epoch=epoch, step_id=step, entry_id="0-1",
                                result=b"r", context_length=step + 1, job_id=job or f"j{step}", reply_to="c",
                                reply_ttl_ms=60000, record=record, keep_records=keep, input_staged=True))


async def _session_blobs(scripts: Scripts, sid: str = "s1") -> set[str]:
    stem = scripts.keys.log(sid)
    return {key.decode()[len(stem):] async for key in scripts.redis.scan_iter(match=stem + ":*", count=500)}


async def test_a_large_payload_is_queued_as_the_mark_and_its_bytes_never_enter_lua(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    await redis.config_set("slowlog-log-slower-than", 0)  # log every command with its arguments
    try:
        await redis.slowlog_reset()
        assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)
        log = await redis.slowlog_get(128)
    finally:
        await redis.config_set("slowlog-log-slower-than", 10000)
    assert await _entry_payload(scripts) == STAGED
    assert await redis.get(k.input_blob("s1", "j0")) == big(0)
    assert await redis.pttl(k.input_blob("s1", "j0")) == -1  # lives as long as its entry
    assert await _session_blobs(scripts) == {":in:j0"}  # the staging was moved, not copied
    commands = {bytes(entry["command"]).split(b" ")[0].upper(): bytes(entry["command"]) for entry in log}
    assert b"more bytes" in commands[b"SET"]  # the payload went as a plain SET argument...
    assert b"more bytes" not in commands[b"EVALSHA"] and len(commands[b"EVALSHA"]) < 1000  # ...not to Lua
    # a small payload keeps the inline path
    assert isinstance(await _enqueue(scripts, 1, b"small"), Queued)
    assert await _entry_payload(scripts) == b"small"


async def test_an_inline_payload_is_never_taken_for_the_mark(scripts: Scripts) -> None:
    """A small payload that starts like the mark is staged too, so an entry's payload is the mark only
    when it was staged."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert isinstance(await _enqueue(scripts, 0, STAGED), Queued)
    assert await _entry_payload(scripts) == STAGED and await redis.get(k.input_blob("s1", "j0")) == STAGED


async def test_a_refused_enqueue_leaves_no_staging_and_changes_nothing(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    out_of_order = await _enqueue(scripts, 5, big(5))
    assert isinstance(out_of_order, Refused) and out_of_order.code is ErrorCode.STEP_OUT_OF_ORDER
    assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)
    in_flight = await _enqueue(scripts, 0, big(0), job="again")  # the same step re-sent while queued
    assert isinstance(in_flight, Refused) and in_flight.in_flight
    assert await _session_blobs(scripts) == {":in:j0"}
    assert await redis.get(k.input_blob("s1", "j0")) == big(0)  # the queued step's input is untouched
    assert await redis.xlen(k.inbox("w1")) == 1


async def test_an_enqueue_whose_staging_is_missing_changes_nothing(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    keys = [k.session("s1"), k.inbox("w1"), k.log("s1"), k.announced, k.worker("w1"), k.staged_input("s1", "t"),
            k.input_blob("s1", "j0")]
    raw = await redis.eval(lua_source("enqueue"), len(keys), *keys, 0, "j0", "", "s1", "w1", 0, 0, "1", "c")
    assert raw == [b"unstaged", -1]
    with pytest.raises(RedisConnectionError):
        unless_unstaged(raw)
    assert await redis.hget(k.session("s1"), "next_step_id") == b"0" and await redis.xlen(k.inbox("w1")) == 0


async def test_a_commit_moves_the_input_to_its_record_and_retention_drops_it(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, retention="last:2")
    for step in range(4):
        assert isinstance(await _enqueue(scripts, step, big(step)), Queued)
        assert await _commit(scripts, step, keep=2) == Committed()
        assert await redis.get(k.record_blob("s1", step)) == big(step)
        assert await redis.hget(k.log("s1"), f"input:{step}") == b"record"
    assert await _session_blobs(scripts) == {":inrec:2", ":inrec:3"}  # last:2, and no input blob left
    assert isinstance(await _enqueue(scripts, 4, big(4)), Queued)
    assert await _commit(scripts, 4, keep=0) == Committed()  # no record kept: the input goes
    assert await _session_blobs(scripts) == {":inrec:2", ":inrec:3"}


async def test_a_duplicate_drops_its_input_and_a_fenced_commit_leaves_it(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)
    assert await _commit(scripts, 0, worker="zombie") == StaleOwner("w1", 1)
    assert await redis.get(k.input_blob("s1", "j0")) == big(0)  # the entry may live on elsewhere
    assert await _commit(scripts, 0) == Committed()
    await redis.set(k.input_blob("s1", "dup"), big(9))  # a second entry of step 0 (a re-sent step)
    assert await _commit(scripts, 0, job="dup") == Duplicate()
    assert await _session_blobs(scripts) == {":inrec:0"}


async def test_a_report_drops_the_input_with_its_entry_unless_fenced(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)

    async def report(worker: str) -> object:
        return await scripts.report(session_id="s1", worker_id=worker, epoch=1, entry_id="0-1", job_id="j0",
                                    result=b"failed", fallback_gen=0, reply_to="c", reply_ttl_ms=60000)

    assert await report("zombie") == StaleOwner("w1", 1)
    assert await redis.get(k.input_blob("s1", "j0")) == big(0)
    assert isinstance(await report("w1"), Published)
    assert await _session_blobs(scripts) == set()


async def test_reset_close_and_fork_treat_record_blobs_like_result_blobs(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)
    assert await _commit(scripts, 0) == Committed()
    assert await scripts.fork("s1", "w1", mode="world_model_env", model="m", branches=["b1"]) == Forked(0)
    assert await redis.get(k.record_blob("b1", 0)) == big(0)  # the branch's own copy

    async def control(kind: str, sid: str) -> None:
        queued = await scripts.control(sid, "w1", kind=kind, job_id=kind, reply_to="c")
        assert isinstance(queued, Queued)
        await redis.xreadgroup(INBOX_GROUP, "w1", {k.inbox("w1"): ">"})
        await scripts.apply_control(session_id=sid, worker_id="w1", epoch=1, entry_id=queued.entry_id,
                                    job_id=kind, kind=kind, mode="world_model_env", model="m", reply_to="c",
                                    grace_ms=30_000, reply_ttl_ms=1000)

    await redis.delete(k.inbox("w1"))  # the fork entry: not under test here
    await redis.xgroup_create(k.inbox("w1"), INBOX_GROUP, id="0", mkstream=True)
    await control("reset", "s1")
    assert await _session_blobs(scripts) == set()
    assert await redis.get(k.record_blob("b1", 0)) == big(0)  # the parent's reset never reaches the branch
    await control("close", "b1")
    assert 0 < await redis.pttl(k.record_blob("b1", 0)) <= 30_000  # expires with the branch's log


async def test_a_retired_workers_orphan_keeps_its_staged_payload_within_the_budget(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert isinstance(await _enqueue(scripts, 0, big(0)), Queued)
    await redis.hset(k.session("s1"), "next_step_id", "0")  # room for a second entry of a payload too large to keep
    assert isinstance(await _enqueue(scripts, 0, big(1, DEAD_LETTER_PAYLOAD_BYTES + 1), job="huge"), Queued)
    await redis.delete(k.session("s1"))  # the session is gone: its entries are orphans
    await redis.zadd(k.workers, {"w1": 0})  # and its worker long dead
    await scripts.retire("w1", pools=[k.pool("world_model_env", "m")], lease_ms=1000, reason="expired")
    letters = {fields[b"job_id"]: fields for _, fields in await redis.xrange(k.dead)}
    assert letters[b"j0"][b"payload"] == big(0) and b"payload_dropped" not in letters[b"j0"]
    assert letters[b"huge"][b"payload"] == b""
    assert b"too large to keep" in letters[b"huge"][b"payload_dropped"]
    assert await _session_blobs(scripts) == set()


async def test_large_observations_survive_a_killed_worker_bit_for_bit(fleet: FleetClient, workers: WorkerPool,
                                                                      scripts: Scripts) -> None:
    """A world session whose every observation is staged: its owner is SIGKILLed after 6 steps, the
    new owner rebuilds the context from the staged inputs of the records, and every step equals a
    fault-free twin's. Once both sessions are closed and read, no input blob is left."""
    shape = (1, 4, 2, 8, 10)
    a = await workers.add(ReferenceEngine(ReferenceEngineConfig(latent_shape=shape)), **FAST)
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    b = await workers.add(ReferenceEngine(ReferenceEngineConfig(latent_shape=shape)), **FAST)
    twin = await fleet.create_session(model="reference-world", mode="world_model_env")
    assert s.owner == a.id and twin.owner == b.id

    async def steps(numbers: range) -> None:
        for i in numbers:
            r, t = await asyncio.gather(s.step(i, **large_step(i)), twin.step(i, **large_step(i)))
            assert r.output is not None and t.output is not None, (r.error, t.error)
            assert np.array_equal(r.output["video_latent"], t.output["video_latent"]), i

    await steps(range(6))
    keys = fleet.keys_of(s.session_id)
    assert await fleet.redis.exists(keys.record_blob(s.session_id, 5))
    await workers.kill(a)
    await reap_until_moved(scripts, a.id)
    await steps(range(6, 9))
    diverged, same = await s.step(9, **large_step(10)), await twin.step(9, **large_step(9))
    assert diverged.output is not None and same.output is not None
    # the images drive the output, so the equal steps above read the right bytes
    assert not np.array_equal(diverged.output["video_latent"], same.output["video_latent"])
    await s.close()
    await twin.close()
    inputs = [key async for key in fleet.redis.scan_iter(match=keys.log("*") + ":in:*")]
    assert inputs == []


async def test_a_dead_lettered_step_keeps_its_staged_payload_and_replays(fleet: FleetClient, workers: WorkerPool,
                                                                        scripts: Scripts) -> None:
    engine = BreakableEngine()
    await workers.add(engine, max_attempts=2, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **large_step(0))).ok
    engine.broken = True
    assert (await s.step(1, **large_step(1))).error is not None
    engine.broken = False
    [dead] = await list_dead(scripts)
    assert len(dead.payload) > STAGE_BYTES and not dead.payload_dropped
    [outcome] = await replay(scripts, [dead])
    assert outcome.status == "queued"
    for _ in range(200):  # bounded: 200 polls of 20 ms
        if (await s.status()).committed_step_id == 1:
            break
        await asyncio.sleep(0.02)
    assert (await s.status()).committed_step_id == 1
    keys = fleet.keys_of(s.session_id)
    assert [key async for key in fleet.redis.scan_iter(match=keys.log(s.session_id) + ":in:*")] == []


@pytest.mark.parametrize("staged", [True, False])
async def test_a_malformed_entry_takes_its_input_blob_with_it(fleet: FleetClient, workers: WorkerPool,
                                                              staged: bool) -> None:
    """A malformed entry is dead-lettered, not replayable: its staged input, which only that entry
    names, is deleted with it; an entry with its payload inline leaves a same-named key alone."""
    w = await workers.add(ReferenceEngine(ReferenceEngineConfig()), **FAST)
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    blob = fleet.keys.input_blob(s.session_id, "junk-blob")
    await fleet.redis.set(blob, big(1))
    answered = fleet.replies.expect("junk-blob")
    await fleet.redis.xadd(fleet.keys.inbox(w.id), {
        "kind": "step", "job_id": "junk-blob", "session_id": s.session_id, "reply_to": fleet.client_id,
        "step_id": "zero", "payload": STAGED if staged else b"inline"})
    r = fleet.decode_result(await asyncio.wait_for(answered, 10), 0.0)
    assert r.error is not None and r.error.code is ErrorCode.INVALID_REQUEST, r.error
    assert await fleet.redis.exists(blob) == (0 if staged else 1)
    assert (await s.step(0, **large_step(0))).ok  # still serving, staged steps included
