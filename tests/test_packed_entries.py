"""The packed inbox entry (broker/redis/inbox.py): written only to an owner that says it reads one,
read as the classic entry is, unpacked by failover for an owner that does not and by retire for
the dead letter, so a worker or replay of an earlier release never meets one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker import FleetClient
from broker.redis.inbox import BadEntry, InboxEntry, JobKind, parse_inbox_entry
from broker.redis.layouts import PACKED, PACKED_PARTS, READS_FIELD, READS_PACKED, DeadLetter, unpacked
from broker.redis.script_replies import Created, FailedOver, Queued, Retired
from broker.redis.scripts import Scripts
from schemas.messages import Mode
from schemas.sharing import Priority
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

MODE = "tokens"
PRELUDE = Path(__file__).resolve().parent.parent / "broker" / "redis" / "lua" / "prelude.lua"
CLASSIC = {b"kind", b"job_id", b"session_id", b"step_id", b"contextual", b"epoch", b"gen", b"mode", b"model",
           b"reply_to", b"enqueued_ms", b"attempt", b"payload"}
PACKED_FIELDS = {b"session_id", b"epoch", b"job_id", b"reply_to", PACKED, b"payload"}


async def _register(scripts: Scripts, wid: str, model: str, *, packed: bool) -> None:
    fields = {"state": "active", **({READS_FIELD: READS_PACKED} if packed else {})}
    await scripts.register(wid, capacity=8, pools=[scripts.keys.pool(MODE, model)], ttl_ms=60_000, fields=fields)


async def _enqueue(scripts: Scripts, sid: str, owner: str, step: int, payload: bytes = b"\x85in") -> None:
    reply = await scripts.enqueue(sid, owner, step_id=step, contextual=True, job_id=f"j{step}", reply_to="trainer-1",
                                  payload=payload, attempt=2)
    assert isinstance(reply, Queued), reply


async def _entries(scripts: Scripts, wid: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [(entry_id, fields) for entry_id, fields in await scripts.redis.xrange(scripts.keys.inbox(wid))]


async def _first_entry(scripts: Scripts, wid: str, *, packed: bool,
                       priority: str = "bulk") -> tuple[bytes, dict[bytes, bytes]]:
    """The entry of step 0 of a new session on a new worker ``wid``, as the inbox holds it."""
    await _register(scripts, wid, "m", packed=packed)
    created = await scripts.create("s1", MODE, "m", lease_ms=5000, retention="full", result_window=1,
                                   priority=priority)
    assert created == Created(wid)
    await _enqueue(scripts, "s1", wid, 0)
    [(entry_id, fields)] = await _entries(scripts, wid)
    return entry_id, fields


def _same_job(a: InboxEntry, b: InboxEntry, **differ: object) -> None:
    """``a`` and ``b`` are one job, but for the entry id and what ``differ`` names (``b``'s values)."""
    fields = {name: getattr(a, name) for name in a.__dataclass_fields__ if name != "entry_id"}
    assert {name: getattr(b, name) for name in fields} == {**fields, **differ}


async def test_an_owner_that_reads_packed_entries_gets_six_fields_read_as_the_classic_entry(scripts: Scripts) -> None:
    entry_id, fields = await _first_entry(scripts, "w-new", packed=True)
    assert set(fields) == PACKED_FIELDS
    entry = InboxEntry.from_fields(entry_id, fields)
    assert (entry.kind, entry.session_id, entry.step_id, entry.job_id, entry.reply_to) == (JobKind.STEP, "s1", 0, "j0",
                                                                                          "trainer-1")
    assert (entry.contextual, entry.epoch, entry.gen, entry.mode, entry.model) == (True, 1, 0, Mode.TOKENS, "m")
    assert (entry.attempt, entry.payload, entry.priority, entry.cancels) == (2, b"\x85in", Priority.BULK, 0)
    assert entry.enqueued_ms > 0
    classic = unpacked(fields)
    assert set(classic) == CLASSIC
    _same_job(entry, InboxEntry.from_fields(entry_id, classic))


async def test_an_owner_that_does_not_say_so_gets_the_classic_entry(scripts: Scripts) -> None:
    entry_id, fields = await _first_entry(scripts, "w-old", packed=False)
    assert set(fields) == CLASSIC
    assert InboxEntry.from_fields(entry_id, fields).job_id == "j0"


async def test_a_packed_entry_keeps_the_fields_that_differ_from_their_defaults(scripts: Scripts) -> None:
    entry_id, fields = await _first_entry(scripts, "w-new", packed=True, priority="interactive")
    assert set(fields) == PACKED_FIELDS | {b"retention", b"min_version", b"priority", b"cancels"}
    assert InboxEntry.from_fields(entry_id, fields).priority is Priority.INTERACTIVE


@pytest.mark.parametrize("new_reads_packed", [False, True], ids=["to an earlier release", "to this release"])
async def test_failover_unpacks_for_an_owner_that_does_not_read_packed_entries(scripts: Scripts,
                                                                                new_reads_packed: bool) -> None:
    model = "m\0with a nul"  # the one part that may hold a NUL: the Lua and the Python split agree on it
    await _register(scripts, "w-a", model, packed=True)
    assert await scripts.create("s1", MODE, model, lease_ms=5000, retention="full", result_window=1) == Created("w-a")
    for step in (0, 1):
        await _enqueue(scripts, "s1", "w-a", step)
    before = [InboxEntry.from_fields(entry_id, fields) for entry_id, fields in await _entries(scripts, "w-a")]
    assert [entry.model for entry in before] == [model, model]
    await _register(scripts, "w-b", model, packed=new_reads_packed)
    moved = await scripts.failover(session_id="s1", mode=MODE, model=model, old="w-a", new="w-b", lease_ms=5000,
                                   reason="handover")
    assert moved == FailedOver(2, 2)
    after = await _entries(scripts, "w-b")
    assert [set(fields) for _, fields in after] == [PACKED_FIELDS if new_reads_packed else CLASSIC] * 2
    for old, (entry_id, fields) in zip(before, after, strict=True):
        _same_job(old, InboxEntry.from_fields(entry_id, fields), epoch=2)
    assert await _entries(scripts, "w-a") == []


async def test_retire_dead_letters_a_packed_orphan_unpacked_and_replayable(scripts: Scripts) -> None:
    await _register(scripts, "w-new", "m", packed=True)
    assert await scripts.create("s1", MODE, "m", lease_ms=5000, retention="full", result_window=1) == Created("w-new")
    await _enqueue(scripts, "s1", "w-new", 0, payload=b"observation")
    assert await scripts.retire("w-new", pools=[scripts.keys.pool(MODE, "m")], lease_ms=5000,
                                reason="drained") == Retired(1)
    [(letter_id, fields)] = await scripts.redis.xrange(scripts.keys.dead)
    assert PACKED not in fields and set(fields) >= CLASSIC
    letter = DeadLetter.from_entry(letter_id, fields)
    assert (letter.kind, letter.session_id, letter.step_id, letter.job_id, letter.model, letter.mode,
            letter.reply_to, letter.payload) == ("step", "s1", 0, "j0", "m", MODE, "trainer-1", b"observation")
    assert letter.replayable


_PARTS = {b"session_id": b"s1", b"epoch": b"3", b"job_id": b"j7", b"reply_to": b"trainer-1", b"payload": b"p"}


@pytest.mark.parametrize("packed", [b"step\x007", b"step\x00x\x001\x000\x00tokens\x0017\x000\x00m",
                                    b"step\x007\x001\x000\x00chess\x0017\x000\x00m"],
                         ids=["too few parts", "step id not a number", "unknown mode"])
def test_a_malformed_packed_entry_is_a_bad_entry_that_names_whom_to_answer(packed: bytes) -> None:
    bad = parse_inbox_entry(b"5-0", {**_PARTS, PACKED: packed})
    assert isinstance(bad, BadEntry)
    assert (bad.session_id, bad.job_id, bad.reply_to) == ("s1", "j7", "trainer-1")


def test_a_well_formed_packed_entry_reads_as_its_classic_fields() -> None:
    fields = {**_PARTS, PACKED: b"step\x007\x001\x002\x00tokens\x0017\x001\x00m\x00x"}
    entry = parse_inbox_entry(b"5-0", fields)
    assert isinstance(entry, InboxEntry) and (entry.step_id, entry.gen, entry.model, entry.attempt) == (7, 2, "m\0x", 1)
    _same_job(entry, InboxEntry.from_fields(b"5-0", unpacked(fields)))


def test_the_lua_prelude_and_the_python_layout_name_the_same_parts() -> None:
    prelude = PRELUDE.read_text()
    parts = re.search(r"^local PACKED_PARTS = \{(.*)\}$", prelude, re.M)
    names = re.search(r"^local PACKED_FIELD, READS_FIELD, READS_PACKED = '(\w+)', '(\w+)', '(\w+)'$", prelude, re.M)
    assert parts is not None and names is not None
    assert tuple(re.findall(r"'(\w+)'", parts.group(1))) == PACKED_PARTS
    assert names.groups() == (PACKED.decode(), READS_FIELD, READS_PACKED)


def test_a_dead_letter_that_kept_a_packed_entry_whole_reads_as_its_classic_fields() -> None:
    """An earlier release's retire.lua copies an orphan's fields as they are: a packed entry's
    dead letter still reads (and replays) as the classic one's would."""
    fields = {b"reason": b"orphaned: its session no longer exists", b"worker_id": b"w1", b"failed_ms": b"9",
              **_PARTS, PACKED: b"step\x007\x001\x002\x00tokens\x0017\x001\x00m"}
    letter = DeadLetter.from_entry(b"9-0", fields)
    assert (letter.kind, letter.step_id, letter.mode, letter.model, letter.job_id) == ("step", 7, "tokens", "m", "j7")
    assert letter.replayable
    assert DeadLetter.from_entry(b"9-1", {**fields, PACKED: b"step"}).kind == ""  # malformed: read as it is


async def test_a_worker_of_this_release_says_it_reads_packed_entries_and_runs_them(fleet: FleetClient,
                                                                                   workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(), capacity=4)
    assert await fleet.redis.hget(fleet.keys.worker(running.worker.id), READS_FIELD) == READS_PACKED.encode()
    session = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(3):
        assert (await session.step(i, **world_step(i))).ok
