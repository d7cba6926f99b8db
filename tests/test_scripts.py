"""The Lua scripts called directly: fencing, placement and the commit rules."""

from __future__ import annotations

import asyncio

import pytest

from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import log_result_field, log_result_steps
from broker.redis.script_replies import (
    CommitReply,
    Committed,
    Created,
    Duplicate,
    DuplicateUnstored,
    Moved,
    OutOfOrder,
    Queued,
    Refused,
    StaleOwner,
    Stored,
)
from broker.redis.scripts import BATCH_MARK, CommitCall, Scripts, _batch_layout, lua_source
from schemas.errors import ErrorCode

pytestmark = pytest.mark.asyncio



async def _register(scripts: Scripts, wid: str, capacity: int = 4) -> None:
    await scripts.register(wid, capacity=capacity, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})


async def _session_with_job(scripts: Scripts, wid: str = "w1") -> tuple[str, str]:
    await _register(scripts, wid)
    created = await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full", result_window=2)
    assert created == Created(wid)
    queued = await scripts.enqueue("s1", wid, step_id=0, contextual=True, job_id="j0", reply_to="c",
                                   payload=b"p")
    assert isinstance(queued, Queued)
    return "s1", queued.entry_id


async def _commit(scripts: Scripts, *, worker: str, epoch: int, step: int, entry: str) -> CommitReply:
    return await scripts.commit(CommitCall(session_id="s1", worker_id=worker, epoch=epoch, step_id=step, entry_id=entry,
                                result=b"r", context_length=3, job_id="j", reply_to="c", reply_ttl_ms=60000))


async def test_commit_with_a_stale_epoch_or_foreign_owner_is_refused(scripts: Scripts) -> None:
    sid, entry = await _session_with_job(scripts)
    redis, keys = scripts.redis, scripts.keys
    assert await _commit(scripts, worker="w1", epoch=2, step=0, entry=entry) == StaleOwner("w1", 1)
    assert await _commit(scripts, worker="w2", epoch=1, step=0, entry=entry) == StaleOwner("w1", 1)
    assert await redis.hget(keys.session(sid), "committed_step_id") == b"-1"
    assert await redis.xlen(keys.reply("c")) == 0  # a refused commit publishes nothing
    pending = await redis.xpending(keys.inbox("w1"), INBOX_GROUP)
    assert pending["pending"] == 0 and await redis.xlen(keys.inbox("w1")) == 1  # the job is still there
    # the real owner at the current epoch commits once; a second commit is a duplicate
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == Committed()
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == Duplicate()
    assert await redis.hget(keys.session(sid), "committed_step_id") == b"0"
    assert await redis.xlen(keys.reply("c")) == 2  # the result, then the stored result again


async def test_after_an_epoch_bump_the_old_owner_cannot_commit(scripts: Scripts) -> None:
    sid, entry = await _session_with_job(scripts)
    await scripts.redis.hset(scripts.keys.session(sid), mapping={"owner": "w2", "epoch": 2})
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == StaleOwner("w2", 2)
    assert await _commit(scripts, worker="w2", epoch=2, step=0, entry=entry) == Committed()


async def test_commit_never_skips_a_step(scripts: Scripts) -> None:
    _, entry = await _session_with_job(scripts)
    assert await _commit(scripts, worker="w1", epoch=1, step=1, entry=entry) == OutOfOrder(-1)
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == Committed()


async def _commit_steps(scripts: Scripts, sid: str, entry: str, steps: range) -> None:
    """Commit these steps of session s1 (step 0's entry already queued), each with result r<step>."""
    for step in steps:
        if step:
            q = await scripts.enqueue(sid, "w1", step_id=step, contextual=True, job_id=f"j{step}", reply_to="c",
                                      payload=b"p")
            assert isinstance(q, Queued)
            entry = q.entry_id
        reply = await scripts.commit(CommitCall(session_id=sid, worker_id="w1", epoch=1, step_id=step, entry_id=entry,
                                                result=b"r%d" % step, context_length=3, job_id=f"j{step}",
                                                reply_to="c", reply_ttl_ms=60000))
        assert reply == Committed()


async def test_result_window_keeps_only_the_latest_results(scripts: Scripts) -> None:
    sid, entry = await _session_with_job(scripts)
    await _commit_steps(scripts, sid, entry, range(4))
    log = await scripts.redis.hgetall(scripts.keys.log(sid))
    # a window of 2 is two fields: each commit overwrote the slot of the result that fell out
    assert log == {log_result_field(2, 2).encode(): b"r2", log_result_field(3, 2).encode(): b"r3"}
    assert log_result_steps(log, 3, 2) == [2, 3]
    resent = await scripts.enqueue(sid, "w1", step_id=2, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert resent == Stored(b"r2", 3)
    # step 1 fell out: its slot holds step 3's result, which must never answer for step 1
    gone = await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert isinstance(gone, Refused) and gone.code is ErrorCode.STEP_ALREADY_COMMITTED
    again = CommitCall(session_id=sid, worker_id="w1", epoch=1, step_id=1, entry_id="0-1", result=b"x",
                       context_length=3, job_id="j1", reply_to="c", reply_ttl_ms=60000)
    assert await scripts.commit(again) == DuplicateUnstored(3)


async def test_a_log_written_before_the_ring_still_answers_inside_the_window(scripts: Scripts) -> None:
    sid, entry = await _session_with_job(scripts)
    await _commit_steps(scripts, sid, entry, range(2))
    # the earlier layout: a field per step, result:<step>
    log = scripts.keys.log(sid)
    await scripts.redis.delete(log)
    await scripts.redis.hset(log, mapping={"result:0": b"old0", "result:1": b"old1"})
    resent = await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert resent == Stored(b"old1", 1)
    await _commit_steps(scripts, sid, "", range(2, 3))
    assert log_result_steps(await scripts.redis.hkeys(log), 2, 2) == [1, 2]
    assert await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="r", reply_to="c",
                                 payload=b"p") == Stored(b"old1", 2)
    gone = await scripts.enqueue(sid, "w1", step_id=0, contextual=True, job_id="r", reply_to="c", payload=b"p")
    assert isinstance(gone, Refused) and gone.code is ErrorCode.STEP_ALREADY_COMMITTED  # its field is left, unread


async def test_placement_prefers_the_least_loaded_live_worker(scripts: Scripts) -> None:
    await _register(scripts, "a", capacity=2)
    await _register(scripts, "b", capacity=2)
    owners = [await scripts.create(f"s{i}", "tokens", "m", lease_ms=5000, retention="full", result_window=1)
              for i in range(4)]
    assert sorted(owners, key=repr) == [Created("a"), Created("a"), Created("b"), Created("b")]
    full = await scripts.create("s9", "tokens", "m", lease_ms=5000, retention="full", result_window=1)
    assert isinstance(full, Refused) and full.code is ErrorCode.CAPACITY_EXHAUSTED


async def test_placement_skips_workers_whose_lease_expired(scripts: Scripts) -> None:
    await _register(scripts, "old")
    await asyncio.sleep(0.05)
    await _register(scripts, "new")
    await scripts.redis.zadd(scripts.keys.workers, {"old": 0})  # heartbeat long ago
    owners = {await scripts.create(f"s{i}", "tokens", "m", lease_ms=5000, retention="full", result_window=1)
              for i in range(3)}
    assert owners == {Created("new")}


async def test_enqueue_to_a_stale_owner_is_told_where_the_session_moved(scripts: Scripts) -> None:
    sid, _ = await _session_with_job(scripts)
    await scripts.redis.hset(scripts.keys.session(sid), mapping={"owner": "w2", "epoch": 2})
    moved = await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="j1", reply_to="c", payload=b"p")
    assert moved == Moved("w2")
    assert await scripts.redis.xlen(scripts.keys.inbox("w1")) == 1  # nothing added to the old inbox


async def test_a_commit_whose_enqueue_the_master_lost_moves_the_next_step_past_it(scripts: Scripts) -> None:
    """A promoted replica that never had step 0's enqueue (next_step_id still 0) takes its commit
    from the worker that ran it: the session then expects step 1, not step 0 for ever."""
    sid, entry = await _session_with_job(scripts)
    await scripts.redis.hset(scripts.keys.session(sid), "next_step_id", 0)  # the enqueue the failover lost
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == Committed()
    assert await scripts.redis.hget(scripts.keys.session(sid), "next_step_id") == b"1"
    queued = await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="j1", reply_to="c", payload=b"p")
    assert isinstance(queued, Queued)


async def test_a_commit_leaves_the_steps_queued_behind_it_alone(scripts: Scripts) -> None:
    sid, entry = await _session_with_job(scripts)
    for step in (1, 2):
        assert isinstance(await scripts.enqueue(sid, "w1", step_id=step, contextual=True, job_id=f"j{step}",
                                                reply_to="c", payload=b"p"), Queued)
    assert await _commit(scripts, worker="w1", epoch=1, step=0, entry=entry) == Committed()
    assert await scripts.redis.hget(scripts.keys.session(sid), "next_step_id") == b"3"


async def test_a_commit_before_a_queued_reset_leaves_the_new_generation_alone(scripts: Scripts) -> None:
    """Steps 0..2, a reset and the new generation's step 0 are queued; step 2 commits after the
    reset's enqueue moved next_step_id to 0: the new generation's steps still enqueue in order."""
    sid, entry = await _session_with_job(scripts)
    entries = [entry]
    for step in (1, 2):
        queued = await scripts.enqueue(sid, "w1", step_id=step, contextual=True, job_id=f"j{step}", reply_to="c",
                                       payload=b"p")
        assert isinstance(queued, Queued)
        entries.append(queued.entry_id)
    await scripts.control(sid, "w1", kind="reset", job_id="r", reply_to="c")
    assert isinstance(await scripts.enqueue(sid, "w1", step_id=0, contextual=True, job_id="n0", reply_to="c",
                                            payload=b"p"), Queued)
    for step, e in enumerate(entries):
        assert await _commit(scripts, worker="w1", epoch=1, step=step, entry=e) == Committed()
    assert await scripts.redis.hget(scripts.keys.session(sid), "next_step_id") == b"1"
    assert isinstance(await scripts.enqueue(sid, "w1", step_id=1, contextual=True, job_id="n1", reply_to="c",
                                            payload=b"p"), Queued)


async def _command_calls(scripts: Scripts) -> dict[str, int]:
    stats = await scripts.redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def test_calls_of_one_turn_run_as_one_script_call_and_each_gets_its_own_reply(scripts: Scripts) -> None:
    """Enqueues, then commits, made in one event-loop turn leave as one script call each
    (prelude.lua run_batch): one XACK and one XDEL for all the commits, and every caller gets its
    own reply, a fenced or failing call among them included, without stopping the others."""
    await _register(scripts, "w1", capacity=8)
    sessions = [f"s{i}" for i in range(4)]
    for sid in sessions:
        assert await scripts.create(sid, "tokens", "m", lease_ms=5000, retention="full",
                                    result_window=1) == Created("w1")
    await scripts.redis.set(scripts.keys.session("broken"), "not a hash")  # WRONGTYPE inside its call
    for name in ("enqueue", "commit"):  # loaded: no NOSCRIPT round in the counts
        await scripts.redis.script_load(lua_source(name))
    before = await _command_calls(scripts)
    queued = await asyncio.gather(*(scripts.enqueue(sid, "w1", step_id=0, contextual=True, job_id=f"j-{sid}",
                                                    reply_to="c", payload=b"p") for sid in sessions),
                                  scripts.enqueue("broken", "w1", step_id=0, contextual=True, job_id="j-broken",
                                                  reply_to="c", payload=b"p"), return_exceptions=True)
    assert all(isinstance(q, Queued) for q in queued[:4]), queued
    assert isinstance(queued[4], Exception) and "WRONGTYPE" in str(queued[4])
    after_enqueue = await _command_calls(scripts)
    assert after_enqueue["evalsha"] - before["evalsha"] == 1
    assert after_enqueue["xadd"] - before.get("xadd", 0) == 4
    assert after_enqueue["time"] - before.get("time", 0) == 1

    def commit(sid: str, entry: str, epoch: int = 1) -> CommitCall:
        return CommitCall(session_id=sid, worker_id="w1", epoch=epoch, step_id=0, entry_id=entry,
                          result=b"r-" + sid.encode(), context_length=1, job_id=f"j-{sid}", reply_to="c",
                          reply_ttl_ms=60000)

    entries = [q.entry_id for q in queued[:4] if isinstance(q, Queued)]
    replies = await asyncio.gather(scripts.commit(commit(sessions[0], entries[0])),
                                   scripts.commit(commit(sessions[1], entries[1], epoch=7)),  # fenced
                                   scripts.commit(commit(sessions[2], entries[2])),
                                   scripts.commit(commit(sessions[3], entries[3])))
    assert replies == [Committed(), StaleOwner("w1", 1), Committed(), Committed()]
    after_commit = await _command_calls(scripts)
    assert after_commit["evalsha"] - after_enqueue["evalsha"] == 1
    assert after_commit["xack"] - after_enqueue.get("xack", 0) == 1
    assert after_commit["xdel"] - after_enqueue.get("xdel", 0) == 1
    redis, keys = scripts.redis, scripts.keys
    assert [await redis.hget(keys.session(sid), "committed_step_id") for sid in sessions] == [b"0", b"-1", b"0", b"0"]
    results = [fields[b"result"] for _, fields in await redis.xrange(keys.reply("c"))]
    assert sorted(results) == [b"r-s0", b"r-s2", b"r-s3"]
    assert (await redis.xpending(keys.inbox("w1"), INBOX_GROUP))["pending"] == 0
    assert await redis.xlen(keys.inbox("w1")) == 1  # the fenced step's entry stays for its owner
    assert 0 < await redis.pttl(keys.reply("c")) <= 60000


async def test_a_batch_sends_the_arguments_its_calls_share_once_and_each_call_runs_with_its_own(
        scripts: Scripts) -> None:
    """A run of calls of one shape sends its calls' equal trailing ARGV once (prelude.lua run_batch):
    each call still runs with its own values, those that differ from the others' included, and a
    call of another shape (a commit with more KEYS) runs as a call of its own."""
    await _register(scripts, "w1", capacity=8)
    sessions = ["s0", "s1", "s2"]
    for sid in sessions:
        assert await scripts.create(sid, "tokens", "m", lease_ms=5000, retention="full",
                                    result_window=1) == Created("w1")
    for name in ("enqueue", "commit"):
        await scripts.redis.script_load(lua_source(name))
    redis, keys = scripts.redis, scripts.keys
    before = await _command_calls(scripts)
    reply_to = {"s0": "c1", "s1": "c1", "s2": "c2"}  # the last ARGV: differs in one call, so nothing is shared
    queued = await asyncio.gather(*(scripts.enqueue(sid, "w1", step_id=0, contextual=True, job_id=f"j-{sid}",
                                                    reply_to=reply_to[sid], payload=sid.encode()) for sid in sessions))
    assert all(isinstance(q, Queued) for q in queued), queued
    assert (await _command_calls(scripts))["evalsha"] - before["evalsha"] == 1
    entries = {fields[b"session_id"].decode(): fields for _, fields in await redis.xrange(keys.inbox("w1"))}
    assert {sid: (e[b"reply_to"], e[b"payload"], e[b"job_id"]) for sid, e in entries.items()} == {
        sid: (reply_to[sid].encode(), sid.encode(), f"j-{sid}".encode()) for sid in sessions}

    keep = {"s0": -1, "s1": 0, "s2": 2}  # s0 and s1 differ in ARGV 12; s2's count needs KEYS 6-8

    def commit(sid: str, entry: str) -> CommitCall:
        return CommitCall(session_id=sid, worker_id="w1", epoch=1, step_id=0, entry_id=entry,
                          result=b"r-" + sid.encode(), context_length=1, job_id=f"j-{sid}", reply_to=reply_to[sid],
                          reply_ttl_ms=60000, record=b"rec-" + sid.encode(), keep_records=keep[sid])

    calls = [commit(sid, q.entry_id) for sid, q in zip(sessions, queued, strict=True) if isinstance(q, Queued)]
    pending = [("commit", *scripts._commit_call(c)[:2], asyncio.get_running_loop().create_future(), None)
               for c in calls[:2]]
    layout_keys, layout_args = _batch_layout(pending)
    own = 12  # ARGV 12 (records kept) differs: 13-18 are shared
    assert layout_args[:5] == [BATCH_MARK, 2, 5, own, 18 - own]
    assert layout_args[5:11] == pending[0][2][own:] == pending[1][2][own:]
    assert layout_args[11:] == [*pending[0][2][:own], *pending[1][2][:own]]
    assert layout_keys == [*pending[0][1], *pending[1][1]]
    for future in (p[3] for p in pending):
        future.cancel()

    before = await _command_calls(scripts)
    replies = await asyncio.gather(*(scripts.commit(c) for c in calls))
    assert replies == [Committed(), Committed(), Committed()]
    assert (await _command_calls(scripts))["evalsha"] - before["evalsha"] == 2  # s0 and s1 as one call, s2 alone
    assert [await redis.hget(keys.log(sid), "input:0") for sid in sessions] == [b"rec-s0", None, b"rec-s2"]
    assert [fields[b"result"] for _, fields in await redis.xrange(keys.reply("c1"))] == [b"r-s0", b"r-s1"]
    assert [fields[b"result"] for _, fields in await redis.xrange(keys.reply("c2"))] == [b"r-s2"]


async def test_a_batch_of_calls_equal_in_every_argument_runs_each_call(scripts: Scripts) -> None:
    """A commit sent twice in one turn (every ARGV shared, none of a call's own): the first commits,
    the second answers as the duplicate it is and publishes the stored result again."""
    _, entry = await _session_with_job(scripts)
    call = CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=0, entry_id=entry, result=b"r",
                      context_length=3, job_id="j0", reply_to="c", reply_ttl_ms=60000)
    keys, args, _ = scripts._commit_call(call)
    pending = [("commit", keys, args, asyncio.get_running_loop().create_future(), None) for _ in range(2)]
    layout_keys, layout_args = _batch_layout(pending)
    assert layout_args == [BATCH_MARK, 2, 5, 0, 18, *args] and layout_keys == keys + keys
    for future in (p[3] for p in pending):
        future.cancel()
    await scripts.redis.script_load(lua_source("commit"))
    before = await _command_calls(scripts)
    assert await asyncio.gather(scripts.commit(call), scripts.commit(call)) == [Committed(), Duplicate()]
    assert (await _command_calls(scripts))["evalsha"] - before["evalsha"] == 1
    redis, k = scripts.redis, scripts.keys
    assert [fields[b"result"] for _, fields in await redis.xrange(k.reply("c"))] == [b"r", b"r"]
    assert await redis.hget(k.session("s1"), "committed_step_id") == b"0"
