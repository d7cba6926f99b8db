"""Large results outside Lua arguments (broker/redis/blobs.py): staged, moved by commit.lua, read by one GET."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import FleetClient
from broker.client.consumer import Delivery, ResultConsumer
from broker.client.replies import ReplyReader
from broker.redis.blobs import (
    BLOB_MARK,
    IN_PLACE_MARK,
    IN_PLACE_READER_TTL_MS,
    STAGE_BYTES,
    blob_key,
    in_place_keys,
    read_reply_blobs,
    unless_unstaged,
)
from broker.redis.durability import ReplicaWait
from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import ReplyBounds, ReplyEntry, log_result_field
from broker.redis.script_replies import (
    Applied,
    CommitReply,
    Committed,
    Created,
    Duplicate,
    Forked,
    Published,
    Queued,
    Refused,
    StaleOwner,
    Stored,
)
from broker.redis.scripts import CommitCall, Scripts, lua_source
from schemas.codec import decode
from schemas.errors import ErrorCode
from schemas.messages import StepResult
from tests.support import WorkerPool, equals, until, world_step
from workers.engines.null import NullEngine, NullEngineConfig

pytestmark = pytest.mark.asyncio
LATENT = (1, 16, 2, 44, 80)  # one latent of the rollout API's world model: 450,560 float32 bytes


def big(step: int) -> bytes:
    return bytes([step % 251]) * (STAGE_BYTES + 1000 + step)


async def _session(scripts: Scripts, window: int = 2) -> str:
    await scripts.register("w1", capacity=4, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    assert await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full",
                                result_window=window) == Created("w1")
    queued = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="j0", reply_to="c", payload=b"p")
    assert isinstance(queued, Queued)
    return "s1"


async def _commit(scripts: Scripts, step: int, *, worker: str = "w1", epoch: int = 1, job: str = "j",
                  result: bytes | None = None) -> CommitReply:
    return await scripts.commit(CommitCall(session_id="s1", worker_id=worker, epoch=epoch, step_id=step, entry_id="0-1",
                                result=big(step) if result is None else result, context_length=step + 1,
                                job_id=f"{job}{step}", reply_to="c", reply_ttl_ms=60000))


async def _blob_keys(scripts: Scripts) -> set[bytes]:
    stem = scripts.keys.log("s1")
    return {key async for key in scripts.redis.scan_iter(match=stem + ":*", count=500)}


async def _last_reply(scripts: Scripts) -> bytes:
    entries = await scripts.redis.xrevrange(scripts.keys.reply("c"), count=1)
    result: bytes = entries[0][1][b"result"]
    return result


async def _apply_control(scripts: Scripts, kind: str) -> None:
    """Enqueue a reset or close of s1 and apply it as its owner w1 does."""
    redis, k = scripts.redis, scripts.keys
    queued = await scripts.control("s1", "w1", kind=kind, job_id=kind, reply_to="c")
    assert isinstance(queued, Queued)
    await redis.xreadgroup(INBOX_GROUP, "w1", {k.inbox("w1"): ">"})
    applied = await scripts.apply_control(
        session_id="s1", worker_id="w1", epoch=1, entry_id=queued.entry_id, job_id=kind, kind=kind,
        mode="tokens", model="m", reply_to="c", grace_ms=30_000, reply_ttl_ms=1000)
    assert isinstance(applied, Applied)


async def test_a_large_result_is_committed_as_a_reference_to_its_blobs(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert await _commit(scripts, 0) == Committed()
    stored = await redis.hget(k.log("s1"), log_result_field(0, 2))
    assert stored == BLOB_MARK + k.result_blob("s1", 0).encode()
    assert await redis.get(k.result_blob("s1", 0)) == big(0)
    assert await redis.pttl(k.result_blob("s1", 0)) == -1  # kept as long as its log field
    reply = await _last_reply(scripts)
    assert reply == BLOB_MARK + k.reply_blob("c", "j0").encode()
    assert await redis.get(k.reply_blob("c", "j0")) == big(0)
    assert 0 < await redis.pttl(k.reply_blob("c", "j0")) <= 600_000  # the large result's reply TTL
    assert not await redis.exists(k.staged_result("s1", 0, "w1", 1))
    # a small result keeps the inline path
    assert await _commit(scripts, 1, result=b"small") == Committed()
    assert await redis.hget(k.log("s1"), log_result_field(1, 2)) == b"small" and await _last_reply(scripts) == b"small"


async def test_a_duplicate_republishes_the_stored_blob_and_a_resend_reads_it(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert await _commit(scripts, 0) == Committed()
    assert await _commit(scripts, 0, job="again", result=big(7)) == Duplicate()  # never a second commit
    assert not await redis.exists(k.staged_result("s1", 0, "w1", 1))
    assert await _last_reply(scripts) == BLOB_MARK + k.reply_blob("c", "again0").encode()
    assert await redis.get(k.reply_blob("c", "again0")) == big(0)
    stored = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert stored == Stored(big(0), 0)
    await redis.delete(k.result_blob("s1", 0))  # gone: answered as a result that was not stored
    gone = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert isinstance(gone, Refused) and gone.code is ErrorCode.STEP_ALREADY_COMMITTED
    assert gone.committed_step_id == 0 and gone.context_length == 1 and "is gone" in gone.message


async def test_a_fenced_zombie_never_publishes_its_staged_result(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    assert await _commit(scripts, 0, worker="zombie", epoch=1) == StaleOwner("w1", 1)
    assert await _commit(scripts, 0, worker="w1", epoch=0) == StaleOwner("w1", 1)
    assert await _blob_keys(scripts) == set()  # both stagings deleted, nothing stored
    assert await redis.hget(k.log("s1"), log_result_field(0, 2)) is None and await redis.xlen(k.reply("c")) == 0
    assert await redis.hget(k.session("s1"), "committed_step_id") == b"-1"


async def test_window_eviction_reset_and_close_leave_no_blobs(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=2)
    for step in range(4):
        assert await _commit(scripts, step) == Committed()
    assert await _blob_keys(scripts) == {k.result_blob("s1", 2).encode(), k.result_blob("s1", 3).encode()}

    await _apply_control(scripts, "reset")
    assert await _blob_keys(scripts) == set()
    assert await _commit(scripts, 0) == Committed()
    await _apply_control(scripts, "close")
    assert await _blob_keys(scripts) == {k.result_blob("s1", 0).encode()}
    assert 0 < await redis.pttl(k.result_blob("s1", 0)) <= 30_000  # expires with the log


async def test_a_branch_owns_copies_of_the_blobs_it_forks(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    for step in range(3):  # a window of 2 that went round: steps 1 and 2 in its slots
        assert await _commit(scripts, step) == Committed()
    assert await scripts.fork("s1", "w1", mode="tokens", model="m", branches=["b1"]) == Forked(2)
    for step in (1, 2):
        copied = BLOB_MARK + k.result_blob("b1", step).encode()
        assert await redis.hget(k.log("b1"), log_result_field(step, 2)) == copied
        await redis.delete(k.result_blob("s1", step))  # the parent's reset or close never reaches the branch
        stored = await scripts.enqueue("b1", "w1", step_id=step, contextual=True, job_id="r", reply_to="c",
                                       payload=b"p")
        assert stored == Stored(big(step), 2)


async def test_a_replicated_commit_publishes_its_blob_only_on_the_second_call(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    reply, acked = await scripts.commit_and_wait(CommitCall(
        session_id="s1", worker_id="w1", epoch=1, step_id=0,
        entry_id="0-1", result=big(0), context_length=1, job_id="j0", reply_to="c", reply_ttl_ms=60000),
        ReplicaWait(replicas=1, wait_ms=10))
    assert reply == Committed() and acked == 0  # no replica here: written, not published
    assert await redis.xlen(k.reply("c")) == 0 and await redis.get(k.result_blob("s1", 0)) == big(0)
    assert await _commit(scripts, 0, result=b"") == Duplicate()  # the publish once a replica has it
    assert await redis.get(blob_key(await _last_reply(scripts)) or "") == big(0)


async def test_a_latent_round_trip_goes_through_the_blob_path(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)))
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
    first = await s.step(0, **world_step(0))
    assert first.ok, first.error
    latent = first.output["video_latent"]
    assert latent.shape == LATENT and latent.nbytes >= STAGE_BYTES
    keys = fleet.keys_of(s.session_id)
    stored = await fleet.redis.hget(keys.log(s.session_id), log_result_field(0, 2))
    assert blob_key(stored) == keys.result_blob(s.session_id, 0)
    again = await s.step(0, **world_step(0))
    assert again.ok and again.duplicate
    assert np.array_equal(again.output["video_latent"], latent)
    # the reader took each reply blob with the entry it read: none is left behind
    stem = keys.reply(fleet.client_id) + ":blob:"
    assert [key async for key in fleet.redis.scan_iter(match=stem + "*")] == []


async def test_the_reply_stream_budget_bounds_its_blobs(scripts: Scripts) -> None:
    """A reader that left: entries past the stream's byte budget lose their blobs, as a trimmed
    inline entry loses its bytes."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=1)
    bounds = ReplyBounds(stream_bytes=3 * (len(big(9)) + 128))  # about 3 latents
    for step in range(8):
        assert await scripts.commit(CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=step, entry_id="0-1",
                                    result=big(step), context_length=step + 1, job_id=f"j{step}", reply_to="c",
                                    reply_ttl_ms=60000, reply_bounds=bounds)) == Committed()
    blobs = [key async for key in redis.scan_iter(match=k.reply("c") + ":blob:*")]
    assert sorted(blobs) == [k.reply_blob("c", f"j{step}").encode() for step in range(5, 8)]


async def test_a_large_stateless_result_is_published_as_a_blob(scripts: Scripts) -> None:
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)

    async def report(worker: str) -> object:
        return await scripts.report(session_id="s1", worker_id=worker, epoch=1, entry_id="0-1", job_id="free",
                                    result=big(3), fallback_gen=None, reply_to="c", reply_ttl_ms=60000)

    assert await report("zombie") == StaleOwner("w1", 1)
    assert not await redis.exists(k.staged_reply("c", "free", "zombie")) and await redis.xlen(k.reply("c")) == 0
    assert isinstance(await report("w1"), Published)
    assert await _last_reply(scripts) == BLOB_MARK + k.reply_blob("c", "free").encode()
    assert await redis.get(k.reply_blob("c", "free")) == big(3)
    assert 0 < await redis.pttl(k.reply_blob("c", "free")) <= 600_000
    assert not await redis.exists(k.staged_reply("c", "free", "w1"))
    assert await redis.hget(k.session("s1"), "committed_step_id") == b"-1"  # a report commits nothing


async def test_a_stateless_latent_step_round_trip(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)))
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, use_session_context=False, **world_step(0))
    assert r.ok, r.error
    assert r.output["video_latent"].shape == LATENT and r.committed_step_id == -1
    stream = fleet.keys_of(s.session_id).reply(fleet.client_id)
    left = [key async for key in fleet.redis.scan_iter(match=stream + ":*")]
    reader_key = fleet.keys_of(s.session_id).in_place_reader(fleet.client_id)
    assert left == [reader_key.encode()]  # the running reader's own key, no blob


async def test_a_consumer_group_reads_a_latent_and_its_ack_frees_the_blob(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)))
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.enqueue(0, results_stream="rollouts", **world_step(0))).status == "queued"
    stem = fleet.keys_of(s.session_id).reply("rollouts") + ":blob:"
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        deliveries = []
        for _ in range(50):  # bounded: 50 reads of at most 200 ms
            deliveries += await results.read(block_ms=200)
            if deliveries:
                break
        assert [d.result.step_id for d in deliveries] == [0]
        assert deliveries[0].result.output["video_latent"].shape == LATENT
        assert [key async for key in fleet.redis.scan_iter(match=stem + "*")] != []  # kept until handled
        assert await deliveries[0].ack() is True
    assert [key async for key in fleet.redis.scan_iter(match=stem + "*")] == []


async def test_a_consumer_read_resolves_its_blobs_together_and_skips_handled_steps(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    """One read of several latent results: each delivery gets its own blob's bytes, an entry whose
    blob is gone is dropped (acknowledged, never delivered), and in a later read a re-published copy
    of a step the group handled is acknowledged silently beside a new step that is delivered."""
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)))
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(3)]
    for s in sessions:
        assert (await s.enqueue(0, results_stream="rollouts", **world_step(0))).status == "queued"
    stream = fleet.keys.reply("rollouts")
    await until(lambda: equals(fleet.redis.xlen(stream), 3), "three results published", 30.0)
    entries = await fleet.redis.xrange(stream)
    refs = [ReplyEntry.from_fields(fields).result for _, fields in entries]
    keys = [blob_key(ref) for ref in refs]
    assert all(key is not None for key in keys)
    expected = [await fleet.redis.get(key) for key in keys]
    # the worker runs the three sessions concurrently, so the stream's order is its own
    published = [StepResult.from_wire(decode(data)) for data in expected]
    assert sorted(r.session_id for r in published) == sorted(s.session_id for s in sessions)
    await fleet.redis.delete(keys[2])  # gone (expired) before it was read
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        delivered = await _read_some(results)
        by_session = {d.result.session_id: d for d in delivered}
        assert sorted(by_session) == sorted(r.session_id for r in published[:2])
        for mine in published[:2]:
            delivered_latent = by_session[mine.session_id].result.output["video_latent"]
            assert np.array_equal(delivered_latent, mine.output["video_latent"])
        assert (await fleet.redis.xpending(stream, "g"))["pending"] == 2  # the gone one was acknowledged
        assert await results.ack_many(delivered) == [True, True]
        assert await fleet.redis.exists(*keys) == 0  # the handled blobs went with their acknowledgements
        # a copy of a handled step's entry, result inline (as a re-publish of a small result writes it)
        first = ReplyEntry.from_fields(entries[0][1])
        await fleet.redis.xadd(stream, dataclasses.replace(first, result=expected[0]).to_fields())
        assert (await sessions[0].enqueue(1, results_stream="rollouts", **world_step(1))).status == "queued"
        session_key = fleet.keys_of(sessions[0].session_id).session(sessions[0].session_id)
        # committed and published in one script: step 1's entry is in the stream behind the copy
        await until(lambda: equals(fleet.redis.hget(session_key, "committed_step_id"), b"1"), "step 1 committed", 30.0)
        again = await _read_some(results)
        assert [(d.result.session_id, d.result.step_id) for d in again] == [(sessions[0].session_id, 1)]
        assert (await fleet.redis.xpending(stream, "g"))["pending"] == 1  # the copy was acknowledged


async def _read_some(results: ResultConsumer) -> list[Delivery]:
    """The first read that delivers (a consumer's first read answers its own pending entries)."""
    for _ in range(50):  # bounded: 50 reads of at most 200 ms
        if delivered := await results.read(count=64, block_ms=200):
            return delivered
    return []


async def test_a_commit_whose_staging_is_missing_changes_nothing_and_is_retried(scripts: Scripts) -> None:
    """The SET before the commit failed or was lost: commit.lua answers 'unstaged' before any write,
    and the wrapper raises it as a lost connection, which the worker's retry stages again."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts)
    keys = [k.session("s1"), k.log("s1"), k.inbox("w1"), k.reply("c"), k.reply_blob("c", "j0"),
            k.staged_result("s1", 0, "w1", 1), k.result_blob("s1", 0), k.record_blob("s1", 1)]
    args = [0, "0-1", "j0", "", 1, "", 1, "", "1", "", "0", -1, 60000, *ReplyBounds().args(), INBOX_GROUP, "w1"]
    raw = await redis.eval(lua_source("commit"), len(keys), *keys, *args)
    assert raw == [b"unstaged", -1]
    assert await redis.hget(k.session("s1"), "committed_step_id") == b"-1" and await redis.xlen(k.reply("c")) == 0
    with pytest.raises(RedisConnectionError):
        unless_unstaged(raw)
    assert await _commit(scripts, 0) == Committed()  # the retry stages it again


async def test_a_frame_is_never_taken_for_a_blob_reference() -> None:
    """Inline results are codec frames, which start with 0xC1 like a reference's mark: the mark's
    second byte (0) is never a frame version."""
    from broker.redis.blobs import BLOB_MARK, blob_key
    from schemas.codec import FRAME_VERSION, encode

    frame = encode({"latent": np.zeros((2, 3), np.float32)})
    assert frame[:1] == BLOB_MARK[:1] and FRAME_VERSION != 0
    assert blob_key(frame) is None
    assert blob_key(BLOB_MARK + b"rf:{0}:log:s:blob:3") == "rf:{0}:log:s:blob:3"


async def test_the_reply_reader_resolves_every_blob_of_one_read(scripts: Scripts) -> None:
    """Several replies read at once, with blobs among them (read together), one blob gone and one
    result inline: each waiter gets its own bytes, the gone one keeps its reference, and every
    blob read is deleted (the reader is its one reader)."""
    redis, stream = scripts.redis, scripts.keys.reply("reader-test")
    blobs = {"j1": b"A" * 40_000, "j4": b"B" * 50_000}
    for job, data in blobs.items():
        await redis.set(f"{stream}:blob:{job}", data)
    results = {"j1": BLOB_MARK + f"{stream}:blob:j1".encode(), "j2": b"inline",
               "j3": BLOB_MARK + f"{stream}:blob:gone".encode(), "j4": BLOB_MARK + f"{stream}:blob:j4".encode()}
    reader = ReplyReader(redis, stream, block_ms=100)
    waiting = {job: reader.expect(job) for job in results}
    for job, result in results.items():  # all in the stream before the first read
        await redis.xadd(stream, ReplyEntry("step", job, 0, result).to_fields())
    reader.start()
    try:
        got = {job: (await asyncio.wait_for(fut, 10)).result for job, fut in waiting.items()}
    finally:
        await reader.stop()
    assert got == {**results, **blobs}
    assert await redis.exists(*(f"{stream}:blob:{job}" for job in blobs)) == 0


async def _in_place_commit(scripts: Scripts, step: int, *, bounds: ReplyBounds | None = None,
                           result: bytes | None = None, job: str | None = None) -> bytes:
    """Commit ``step`` to the reply stream "c", whose reader reads in place; its reply's reference."""
    await scripts.redis.set(scripts.keys.in_place_reader("c"), b"1", px=60_000)
    call = CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=step, entry_id="0-1",
                      result=big(step) if result is None else result, context_length=step + 1,
                      job_id=job or f"j{step}", reply_to="c", reply_ttl_ms=60000)
    if bounds is not None:
        call = dataclasses.replace(call, reply_bounds=bounds)
    assert await scripts.commit(call) == Committed()
    return await _last_reply(scripts)


async def test_an_in_place_reply_refers_to_the_log_blob_and_its_read_marks_it_read(scripts: Scripts) -> None:
    """A reply stream whose reader reads in place: the reply refers to the log's blob (no copy), and
    the read takes the bytes, deletes the marker and leaves the blob to the log, which deletes it
    when its window moves on. Without the reader's key the same commit copies."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=2)
    copies = await _command_calls(redis, "copy")
    ref = await _in_place_commit(scripts, 0)
    blob, reply_blob = k.result_blob("s1", 0), k.reply_blob("c", "j0")
    assert ref == IN_PLACE_MARK + blob.encode() + b"\x00" + reply_blob.encode()
    assert blob_key(ref) == blob and in_place_keys(ref) == (blob, reply_blob)
    assert await _command_calls(redis, "copy") == copies and not await redis.exists(reply_blob)
    assert await redis.hkeys(k.in_place_marker(blob)) == [reply_blob.encode()]
    assert 0 < await redis.pttl(k.in_place_marker(blob)) <= 60_000  # the reply's TTL
    assert await read_reply_blobs(redis, [ref]) == [big(0)]
    assert not await redis.exists(k.in_place_marker(blob)) and await redis.get(blob) == big(0)  # still the log's
    stored = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert stored == Stored(big(0), 0)  # a re-send reads it from the log as before
    for step in (1, 2):  # step 0 falls out of the window of 2: its blob goes, no reply blob appears
        await read_reply_blobs(redis, [await _in_place_commit(scripts, step)])
    assert await _blob_keys(scripts) == {k.result_blob("s1", 1).encode(), k.result_blob("s1", 2).encode()}
    assert [key async for key in redis.scan_iter(match=k.reply("c") + ":blob:*")] == []

    await redis.delete(k.in_place_reader("c"))  # its reader left (or is of an earlier release)
    assert await _commit(scripts, 3) == Committed()
    assert await _last_reply(scripts) == BLOB_MARK + k.reply_blob("c", "j3").encode()
    assert await _command_calls(redis, "copy") == copies + 1
    assert await read_reply_blobs(redis, [await _last_reply(scripts)]) == [big(3)]
    assert not await redis.exists(k.reply_blob("c", "j3"))


async def test_the_reply_reader_says_it_reads_in_place_while_it_runs(scripts: Scripts) -> None:
    """A reader given its in_place key keeps it standing while it runs and deletes it on stop; a
    reader without one writes no key (its commits copy)."""
    redis, k = scripts.redis, scripts.keys
    plain = ReplyReader(redis, k.reply("plain"), block_ms=100)
    reader = ReplyReader(redis, k.reply("reader-key"), in_place=k.in_place_reader("reader-key"), block_ms=100)
    plain.start()
    reader.start()
    try:
        async def standing() -> bool:
            return bool(await redis.exists(k.in_place_reader("reader-key")))

        await until(standing, "the reader never said it reads in place", bound_s=10)
        assert 0 < await redis.pttl(k.in_place_reader("reader-key")) <= IN_PLACE_READER_TTL_MS
        assert not await redis.exists(k.in_place_reader("plain"))
    finally:
        await reader.stop()
        await plain.stop()
    assert not await redis.exists(k.in_place_reader("reader-key"))


async def test_an_unread_in_place_result_leaving_the_log_goes_to_its_reader(scripts: Scripts) -> None:
    """Window eviction, a reset and a close of a result whose in-place reply nobody has read yet:
    the blob is renamed to the reader's reply blob (with the reply's TTL), and the read finds it there
    and deletes it. Nothing is lost and nothing stays behind."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=2)
    refs = [await _in_place_commit(scripts, step) for step in range(3)]  # none read; step 0 left the window
    assert not await redis.exists(k.result_blob("s1", 0), k.in_place_marker(k.result_blob("s1", 0)))
    assert await redis.get(k.reply_blob("c", "j0")) == big(0)
    assert 0 < await redis.pttl(k.reply_blob("c", "j0")) <= 60_000
    assert await read_reply_blobs(redis, refs[:1]) == [big(0)]
    assert not await redis.exists(k.reply_blob("c", "j0"))

    await _apply_control(scripts, "reset")
    assert await read_reply_blobs(redis, refs[1:]) == [big(1), big(2)]  # handed over by the reset
    assert await _blob_keys(scripts) == set()
    assert [key async for key in redis.scan_iter(match=k.reply("c") + ":blob:*")] == []

    ref = await _in_place_commit(scripts, 0)  # the new trajectory's first step, unread at the close
    await _apply_control(scripts, "close")
    assert await read_reply_blobs(redis, [ref]) == [big(0)]
    assert [key async for key in redis.scan_iter(match=k.reply("c") + ":blob:*")] == []


async def test_the_reply_stream_budget_drops_the_readers_share_of_an_in_place_result(scripts: Scripts) -> None:
    """Entries past the stream's byte budget: an in-place entry loses its marker (and a blob handed
    over to it), while the log keeps its own blobs for re-sends."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=8)
    bounds = ReplyBounds(stream_bytes=3 * (len(big(9)) + 128))  # about 3 latents
    for step in range(8):
        await _in_place_commit(scripts, step, bounds=bounds)
    markers = sorted([key async for key in redis.scan_iter(match=k.log("s1") + ":blob:*:reader")])
    assert markers == sorted(k.in_place_marker(k.result_blob("s1", step)).encode() for step in range(5, 8))
    assert len([key async for key in redis.scan_iter(match=k.log("s1") + ":blob:*")]) == 8 + 3


async def test_a_latent_step_through_the_client_makes_no_copy_of_its_result(fleet: FleetClient,
                                                                         workers: WorkerPool) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)))
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
    copies = await _command_calls(fleet.redis, "copy")
    results = [await s.step(step, **world_step(step)) for step in range(4)]
    assert all(r.ok for r in results), [r.error for r in results]
    assert await _command_calls(fleet.redis, "copy") == copies
    keys = fleet.keys_of(s.session_id)
    assert [key async for key in fleet.redis.scan_iter(match=keys.log(s.session_id) + ":blob:*:reader")] == []
    assert [key async for key in fleet.redis.scan_iter(match=keys.reply(fleet.client_id) + ":blob:*")] == []
    again = await s.step(3, **world_step(3))
    assert again.ok and again.duplicate and np.array_equal(again.output["video_latent"],
                                                           results[3].output["video_latent"])


async def _command_calls(redis: Redis, name: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


async def test_a_reply_read_after_a_reset_reused_its_step_gets_its_own_result(scripts: Scripts) -> None:
    """A reset hands step 0's unread result to its reader; the new trajectory's step 0 then stores
    other bytes under the same blob name, with its own reader in the marker. The first reply still
    reads its own bytes, and its read leaves the second reply's claim on the new blob standing."""
    redis, k = scripts.redis, scripts.keys
    await _session(scripts, window=2)
    first = await _in_place_commit(scripts, 0, result=b"A" * (STAGE_BYTES + 10), job="old")
    await _apply_control(scripts, "reset")
    second = await _in_place_commit(scripts, 0, result=b"B" * (STAGE_BYTES + 10), job="new")
    blob = k.result_blob("s1", 0)
    assert in_place_keys(first) == (blob, k.reply_blob("c", "old")) and in_place_keys(second)[0] == blob
    assert await read_reply_blobs(redis, [first]) == [b"A" * (STAGE_BYTES + 10)]
    assert await redis.hkeys(k.in_place_marker(blob)) == [k.reply_blob("c", "new").encode()]
    for step in (1, 2):  # the new step 0 leaves the window unread: it goes to its reader
        await _in_place_commit(scripts, step)
    assert await read_reply_blobs(redis, [second]) == [b"B" * (STAGE_BYTES + 10)]
