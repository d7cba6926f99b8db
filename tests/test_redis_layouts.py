"""The field layouts: what the Lua scripts write is what broker.redis.layouts and broker.redis.inbox
read, and what Python writes reads back the same."""

from __future__ import annotations

import dataclasses
import re

import pytest
from redis.exceptions import ResponseError

from broker.redis.inbox import BadEntry, InboxEntry, parse_inbox_entry
from broker.redis.layouts import (
    DeadLetter,
    LayoutError,
    ReplyEntry,
    SessionHash,
    handled_field,
    log_input_field,
    log_result_field,
)
from broker.redis.script_replies import Committed, Queued, Retired
from broker.redis.scripts import PRELUDE_MARK, CommitCall, Scripts, lua_file, lua_source
from schemas.messages import Mode


async def _queued_step(scripts: Scripts) -> InboxEntry:
    await scripts.register("w1", capacity=2, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="last:2", result_window=3)
    queued = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="j0", reply_to="c",
                                   payload=b"p", attempt=2, min_version=5)
    assert isinstance(queued, Queued)
    raw = await scripts.redis.xrange(scripts.keys.inbox("w1"))
    entry = parse_inbox_entry(*raw[0])
    assert isinstance(entry, InboxEntry) and entry.entry_id == queued.entry_id
    return entry


async def test_the_session_hash_create_writes_reads_back(scripts: Scripts) -> None:
    await _queued_step(scripts)
    session = SessionHash.from_fields(await scripts.redis.hgetall(scripts.keys.session("s1")))
    assert (session.mode, session.model, session.owner, session.epoch) == (Mode.TOKENS, "m", "w1", 1)
    assert (session.committed_step_id, session.next_step_id, session.context_length) == (-1, 1, 0)
    assert (session.closed, session.gen, session.reset_pending) == (False, 0, 0)
    assert (session.retention, session.result_window) == ("last:2", 3)
    assert session.created_ms > 0 and session.updated_ms >= session.created_ms
    assert session.status("s1").owner == "w1"


async def test_an_inbox_entry_enqueue_writes_reads_back(scripts: Scripts) -> None:
    entry = await _queued_step(scripts)
    assert (entry.kind, entry.job_id, entry.session_id, entry.step_id, entry.contextual) == ("step", "j0", "s1", 0,
                                                                                             True)
    assert (entry.epoch, entry.gen, entry.mode, entry.model, entry.reply_to) == (1, 0, Mode.TOKENS, "m", "c")
    assert (entry.attempt, entry.payload, entry.retention, entry.min_version) == (2, b"p", "last:2", 5)


_DEFAULTED = (b"retention", b"min_version", b"priority", b"cancels")


@pytest.mark.parametrize("differs", ["none", "retention", "min_version", "priority", "cancels"])
async def test_an_entry_leaves_out_the_four_fields_only_when_all_hold_their_defaults(scripts: Scripts,
                                                                                     differs: str) -> None:
    """enqueue.lua writes retention, min_version, priority and cancels only when one differs from
    its default (full, 0, bulk, 0); either way the worker reads the same values."""
    await scripts.register("w1", capacity=2, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                           fields={"state": "active"})
    await scripts.create("s1", "tokens", "m", lease_ms=5000, result_window=1,
                         retention="last:2" if differs == "retention" else "full",
                         priority="interactive" if differs == "priority" else "bulk")
    if differs == "cancels":
        await scripts.cancel("s1", "w1")
    queued = await scripts.enqueue("s1", "w1", step_id=0, contextual=True, job_id="j0", reply_to="c",
                                   payload=b"p", min_version=7 if differs == "min_version" else 0)
    assert isinstance(queued, Queued)
    [(entry_id, fields)] = await scripts.redis.xrange(scripts.keys.inbox("w1"), queued.entry_id, queued.entry_id)
    entry = parse_inbox_entry(entry_id, fields)
    assert isinstance(entry, InboxEntry)
    assert (entry.retention, entry.min_version, entry.priority.value, entry.cancels) == (
        "last:2" if differs == "retention" else "full", 7 if differs == "min_version" else 0,
        "interactive" if differs == "priority" else "bulk", 1 if differs == "cancels" else 0)
    if differs == "none":
        assert not set(_DEFAULTED) & set(fields) and len(fields) == 13
    else:
        assert set(_DEFAULTED) <= set(fields) and len(fields) == 17
    assert entry == InboxEntry._checked(entry_id, fields)  # the one-pass read and the field-by-field one agree


async def test_commit_writes_a_reply_entry_and_the_log_fields_named_here(scripts: Scripts) -> None:
    entry = await _queued_step(scripts)
    reply = await scripts.commit(CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=0,
                                            entry_id=entry.entry_id, result=b"r", context_length=3, job_id="j0",
                                            reply_to="c", reply_ttl_ms=60000, record=b"rec"))
    assert reply == Committed()
    published = await scripts.redis.xrange(scripts.keys.reply("c"))
    assert ReplyEntry.from_fields(published[0][1]) == ReplyEntry("step", "j0", 0, b"r")
    log = await scripts.redis.hgetall(scripts.keys.log("s1"))
    assert log == {log_result_field(0, 1).encode(): b"r", log_input_field(0).encode(): b"rec"}


def test_a_commit_passes_the_keys_it_may_touch_and_no_more(scripts: Scripts) -> None:
    """commit.lua's KEYS: the common commit passes 5; a staged result or records kept by count add
    the staging, result blob and evicted record keys (8); a staged payload its two blobs (10)."""
    k = scripts.keys
    call = CommitCall(session_id="s1", worker_id="w1", epoch=2, step_id=7, entry_id="1-0", result=b"r",
                      context_length=3, job_id="j7", reply_to="c", reply_ttl_ms=60000)
    common = [k.session("s1"), k.log("s1"), k.inbox("w1"), k.reply("c"), k.reply_blob("c", "j7")]
    tail = [k.staged_result("s1", 7, "w1", 2), k.result_blob("s1", 7)]
    assert scripts._commit_call(call)[0] == common
    assert scripts._commit_call(dataclasses.replace(call, keep_records=0))[0] == common
    assert scripts._commit_call(dataclasses.replace(call, keep_records=3))[0] == [*common, *tail,
                                                                                  k.record_blob("s1", 4)]
    large = dataclasses.replace(call, result=b"x" * scripts.stage_bytes)
    keys, args, before = scripts._commit_call(large)
    assert keys == [*common, *tail, k.record_blob("s1", 8)] and before is not None and args[8] == "1"
    assert scripts._commit_call(dataclasses.replace(call, input_staged=True))[0] == [
        *common, *tail, k.record_blob("s1", 8), k.input_blob("s1", "j7"), k.record_blob("s1", 7)]


@pytest.mark.parametrize("staged", [True, False])
async def test_a_commit_missing_keys_it_needs_is_refused_before_any_write(scripts: Scripts, staged: bool) -> None:
    """A staged result (ARGV 9) or records kept by count (ARGV 12) with only the 5 common KEYS: an
    error names it, and the session, log and inbox are as they were."""
    entry = await _queued_step(scripts)
    call = CommitCall(session_id="s1", worker_id="w1", epoch=1, step_id=0, entry_id=entry.entry_id, result=b"r",
                      context_length=3, job_id="j0", reply_to="c", reply_ttl_ms=60000,
                      keep_records=-1 if staged else 2)
    keys, args, _ = scripts._commit_call(call)
    if staged:
        args[3], args[8] = "", "1"
    redis, k = scripts.redis, scripts.keys

    async def state() -> tuple[object, ...]:
        return (await redis.hgetall(k.session("s1")), await redis.hgetall(k.log("s1")),
                await redis.xrange(k.inbox("w1")), await redis.exists(k.reply("c")))

    before = await state()
    with pytest.raises(ResponseError, match="a staged result or records kept by count need KEYS 6-8"):
        await redis.eval(lua_source("commit"), 5, *keys[:5], *args)
    assert await state() == before and before[0][b"committed_step_id"] == b"-1" and before[3] == 0


async def test_ack_result_marks_the_handled_field_named_here(scripts: Scripts) -> None:
    keys = scripts.keys
    await scripts.redis.xgroup_create(keys.reply("res"), "g", id="0", mkstream=True)
    entry_id = await scripts.redis.xadd(keys.reply("res"), ReplyEntry("step", "j", 4, b"r").to_fields())
    assert await scripts.ack_result(stream="res", group="g", entry_id=entry_id.decode(), session_id="s1", step_id=4,
                                    handled_ttl_ms=60000)
    assert await scripts.redis.hkeys(keys.handled("res", "g")) == [handled_field("s1", 4).encode()]


async def test_a_dead_letter_written_from_a_job_reads_back_replayable(scripts: Scripts) -> None:
    entry = await _queued_step(scripts)
    letter = entry.dead_letter("inference_error: boom", 3, "w1", 1234)
    entry_id = await scripts.redis.xadd(scripts.keys.dead, letter.to_fields())
    read = DeadLetter.from_entry(entry_id, (await scripts.redis.xrange(scripts.keys.dead))[0][1])
    assert read.replayable and read.code == "inference_error"
    assert (read.session_id, read.step_id, read.payload, read.attempts, read.failed_ms) == ("s1", 0, b"p", 3, 1234)
    assert (read.mode, read.model, read.reply_to, read.job_id, read.contextual) == ("tokens", "m", "c", "j0", True)


async def test_retire_dead_letters_orphans_in_the_dead_letter_layout(scripts: Scripts) -> None:
    await _queued_step(scripts)
    retired = await scripts.retire("w1", pools=[scripts.keys.pool("tokens", "m")], lease_ms=5000, reason="drained")
    assert retired == Retired(1)
    raw = await scripts.redis.xrange(scripts.keys.dead)
    letter = DeadLetter.from_entry(*raw[0])
    assert letter.reason.startswith("orphaned") and letter.worker_id == "w1" and letter.failed_ms > 0
    assert (letter.session_id, letter.step_id, letter.payload, letter.replayable) == ("s1", 0, b"p", True)


def test_a_malformed_entry_is_a_bad_entry_with_what_could_be_read() -> None:
    bad = parse_inbox_entry(b"1-0", {b"kind": b"step", b"job_id": b"j", b"reply_to": b"c", b"step_id": b"x"})
    assert isinstance(bad, BadEntry) and bad.job_id == "j" and bad.reply_to == "c"
    assert bad.dead_letter("w1").to_fields() == {"reason": f"invalid_request: {bad.reason}", "entry_id": "1-0",
                                                 "worker_id": "w1", "job_id": "j", "session_id": "",
                                                 "attempts": "0"}
    unknown = parse_inbox_entry("1-1", {b"kind": b"teleport"})
    assert isinstance(unknown, BadEntry) and "unknown job kind" in unknown.reason


_WELL_FORMED = {b"kind": b"step", b"job_id": b"j", b"session_id": b"s", b"step_id": b"3", b"contextual": b"1",
                b"epoch": b"2", b"gen": b"0", b"mode": b"tokens", b"model": b"m", b"reply_to": b"c",
                b"enqueued_ms": b"17", b"attempt": b"0", b"payload": b"p", b"priority": b"interactive"}


def _parsed(read: object, fields: dict[bytes, bytes]) -> object:
    try:
        return read(b"1-0", fields)  # type: ignore[operator]
    except LayoutError as exc:
        return f"LayoutError: {exc}"


@pytest.mark.parametrize("change", [
    {}, {b"priority": None}, {b"cancels": b"4", b"min_version": b" 5 ", b"retention": b"last:2"},
    {b"kind": b"reset", b"step_id": b"-1"}, {b"kind": b"close", b"step_id": b"0"},
    {b"kind": b"fork", b"step_id": b"-1"},
    {b"step_id": b"-1"}, {b"step_id": "\u0663".encode()}, {b"model": b"\xff"}, {b"mode": b"chess"},
    {b"priority": b"urgent"}, {b"kind": b"teleport"}, {b"gen": None}, {b"epoch": b"x"},
])
def test_the_one_pass_inbox_read_answers_what_the_field_by_field_read_does(change: dict[bytes, bytes | None]) -> None:
    fields = {**_WELL_FORMED, **{k: v for k, v in change.items() if v is not None}}
    for name in [k for k, v in change.items() if v is None]:
        del fields[name]
    assert _parsed(InboxEntry.from_fields, fields) == _parsed(InboxEntry._checked, fields)


def test_a_session_hash_missing_a_field_raises_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="missing field 'owner'"):
        SessionHash.from_fields({b"mode": b"tokens", b"model": b"m"})
    with pytest.raises(LayoutError, match="session hash"):
        SessionHash.from_fields({b"mode": b"nonsense"})


@pytest.mark.parametrize("name", Scripts.NAMES)
def test_every_script_has_its_header_and_takes_shared_idioms_from_the_prelude(name: str) -> None:
    source = lua_file(name)
    header = "\n".join(line for line in source.splitlines() if line.startswith("--"))
    for part in ("-- KEYS:", "-- ARGV:", "Returns"):
        assert part in header, f"{name}.lua header lacks {part!r}"
    assert "'TIME'" not in source, "the Redis clock in ms is prelude.lua's now_ms()"
    uses = {fn for fn in ("now_ms", "fenced", "session_refusal") if re.search(rf"\b{fn}\(", source)}
    assert (PRELUDE_MARK in source) == bool(uses)
    assert (lua_source(name) != source) == bool(uses)


def test_create_writes_every_field_of_the_session_hash() -> None:
    source = lua_file("create")
    later = {"first_version"}  # a trajectory's first commit writes it (commit.lua), a reset drops it
    missing = [f.name for f in dataclasses.fields(SessionHash) if f"'{f.name}'" not in source and f.name not in later]
    assert not missing
    assert all(f"'{name}'" in lua_file("commit") for name in later)
