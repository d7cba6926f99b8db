"""Priorities: on a busy worker an interactive session's step runs before the bulk steps queued
ahead of it, and every session's own steps keep their order. Orders are asserted, never times:
the engine holds each batch until the test lets it go, so what waits is known."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from broker import FleetClient
from broker.ops.sessions import list_sessions
from broker.redis.inbox import BadEntry, InboxEntry, parse_inbox_entry
from schemas.errors import InvalidRequestError
from schemas.messages import Mode
from schemas.sharing import Priority
from tests.support import WorkerPool, world_step
from tests.test_batcher import request
from workers.batcher import Batcher
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine
from workers.worker import Admission

MODEL, MODE = "null-world", "world_model_env"
WAIT_S = 20.0  # every wait of these tests is bounded by this


class HeldEngine(NullEngine):
    """Runs a batch only once the test releases it; records which sessions each batch held."""

    def __init__(self, max_batch: int) -> None:
        super().__init__()
        self.max_batch = max_batch
        self.batches: list[list[str]] = []
        self.go = asyncio.Semaphore(0)

    def max_batch_size(self, model: str) -> int:
        return self.max_batch

    def release_all(self) -> None:
        for _ in range(32):
            self.go.release()

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.batches.append([r.session_key for r in requests])
        await self.go.acquire()
        return await super().run_batch(model, requests)


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check()`` (bounded) until it is true."""
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"{what} did not happen within {WAIT_S}s")


@pytest.mark.parametrize("priority", ["interactive", "bulk"])
async def test_an_interactive_step_runs_before_the_bulk_steps_queued_ahead_of_it(
        fleet: FleetClient, workers: WorkerPool, priority: str) -> None:
    engine = HeldEngine(max_batch=2)
    w = await workers.add(engine, capacity=16)
    batcher = w.worker._batchers[MODEL]
    bulk = [await fleet.create_session(model=MODEL, mode=MODE) for _ in range(7)]
    futs = [s.submit(0, **world_step(0)) for s in bulk]
    # The first batch is held in the engine; the other bulk steps wait in the batcher.
    await until(lambda: len(engine.batches) == 1 and batcher.waiting() == 7 - len(engine.batches[0]),
                "the bulk steps queueing")
    late = await fleet.create_session(model=MODEL, mode=MODE, priority=priority)
    futs.append(late.submit(0, **world_step(0)))
    await until(lambda: batcher.waiting() == 8 - len(engine.batches[0]), "the late step queueing")
    engine.release_all()  # every batch may run now: the order is the batcher's alone
    results = await asyncio.wait_for(asyncio.gather(*futs), WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results]
    ran_in = next(i for i, batch in enumerate(engine.batches) if late.session_id in batch)
    if priority == "interactive":  # the next batch, ahead of the bulk steps that waited before it
        assert ran_in == 1 and engine.batches[1][0] == late.session_id
    else:  # bulk waits its turn behind them (the test tells the two apart)
        assert ran_in == len(engine.batches) - 1 > 1


@pytest.mark.parametrize("priority", ["interactive", "bulk"])
async def test_an_interactive_step_takes_the_next_free_slot_ahead_of_bulk_steps_read_before_it(
        fleet: FleetClient, workers: WorkerPool, priority: str) -> None:
    engine = HeldEngine(max_batch=1)
    w = await workers.add(engine, capacity=16, max_inflight=2)  # two jobs read and running at most
    admission = w.worker._inflight
    bulk = [await fleet.create_session(model=MODEL, mode=MODE) for _ in range(4)]
    futs = [s.submit(0, **world_step(0)) for s in bulk]
    await until(lambda: admission.backlog == 2, "two bulk steps waiting for a slot")
    late = await fleet.create_session(model=MODEL, mode=MODE, priority=priority)
    futs.append(late.submit(0, **world_step(0)))
    waiting = (lambda: admission.interactive_waiting == 1) if priority == "interactive" else (
        lambda: admission.backlog == 3)
    await until(waiting, "the late step read")
    engine.release_all()
    results = await asyncio.wait_for(asyncio.gather(*futs), WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results]
    order = [batch[0] for batch in engine.batches]
    later_bulk = [s.session_id for s in bulk if not any(s.session_id in b for b in engine.batches[:2])]
    assert len(later_bulk) == 2  # the two that waited for a slot
    if priority == "interactive":  # the first slot freed went to it, not to the bulk steps read earlier
        assert order.index(late.session_id) < min(order.index(sid) for sid in later_bulk)
    else:
        assert order[-1] == late.session_id


async def test_the_batcher_takes_interactive_requests_first_and_each_class_in_arrival_order() -> None:
    engine = HeldEngine(max_batch=3)
    batcher = Batcher(engine, MODEL, max_batch=3)
    try:
        first = asyncio.create_task(batcher.run(request("b0")))
        await until(lambda: len(engine.batches) == 1, "the first batch")
        order = [("b1", Priority.BULK), ("i1", Priority.INTERACTIVE), ("b2", Priority.BULK),
                 ("b3", Priority.BULK), ("i2", Priority.INTERACTIVE), ("b4", Priority.BULK)]
        rest = [asyncio.create_task(batcher.run(request(name), priority)) for name, priority in order]
        await until(lambda: batcher.waiting() == 6, "the requests queueing")
        assert batcher.waiting(Priority.INTERACTIVE) == 2
        engine.release_all()
        await asyncio.wait_for(asyncio.gather(first, *rest), WAIT_S)
    finally:
        await batcher.close()
    assert engine.batches == [["b0"], ["i1", "i2", "b1"], ["b2", "b3", "b4"]]


def job(sid: str, n: int, priority: Priority = Priority.BULK, kind: str = "step") -> InboxEntry:
    return InboxEntry(entry_id=f"{sid}-{n}", kind=kind, job_id=f"j{n}", session_id=sid,
                      step_id=n if kind == "step" else -1, contextual=True, epoch=1, gen=0,
                      mode=Mode.WORLD_MODEL_ENV, model=MODEL, reply_to="r", enqueued_ms=0, attempt=0,
                      payload=b"", priority=priority)


async def test_admission_gives_a_freed_slot_to_interactive_then_to_the_backlog_in_order() -> None:
    admission, ran = Admission(2, backlog=8), []

    def run(j: InboxEntry | BadEntry) -> None:
        ran.append(j.entry_id)

    for j in (job("a", 0), job("b", 0), job("a", 1), job("b", 1)):
        await admission.admit(j, run)  # two run, two wait in the backlog; the reader reads on
    assert ran == ["a-0", "b-0"] and admission.backlog == 2 and admission.holds("a-1")
    # An interactive step of a session with an entry in the backlog keeps its place behind it.
    await admission.admit(job("a", 2, Priority.INTERACTIVE), run)
    assert admission.backlog == 3
    reader = asyncio.create_task(admission.admit(job("i", 0, Priority.INTERACTIVE), run))
    await until(lambda: admission.interactive_waiting == 1, "the interactive entry waiting")
    admission.release()
    await asyncio.wait_for(reader, WAIT_S)
    assert ran == ["a-0", "b-0", "i-0"]
    for _ in range(3):
        admission.release()
    assert ran == ["a-0", "b-0", "i-0", "a-1", "b-1", "a-2"] and admission.backlog == 0
    assert not admission.holds("a-1")


async def test_a_reader_stopped_while_waiting_leaves_its_slots_to_the_backlog() -> None:
    admission, ran = Admission(1, backlog=8), []
    await admission.admit(job("a", 0), lambda j: ran.append(j.entry_id))
    await admission.admit(job("a", 1), lambda j: ran.append(j.entry_id))
    reader = asyncio.create_task(admission.admit(job("i", 0, Priority.INTERACTIVE), lambda j: ran.append("x")))
    await until(lambda: admission.interactive_waiting == 1, "the interactive entry waiting")
    admission.release()  # kept for the interactive entry...
    reader.cancel()  # ...whose reader stops before it wakes: the slot goes on to the backlog
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert ran == ["a-0", "a-1"] and admission.backlog == 0


def test_an_inbox_entry_carries_its_priority_and_a_bad_one_is_a_bad_entry() -> None:
    fields = {b"kind": b"step", b"job_id": b"j", b"session_id": b"s", b"step_id": b"0", b"contextual": b"1",
              b"epoch": b"1", b"gen": b"0", b"mode": b"tokens", b"model": b"m", b"reply_to": b"r",
              b"enqueued_ms": b"1", b"attempt": b"0", b"payload": b""}
    parsed = parse_inbox_entry(b"1-0", fields)
    assert isinstance(parsed, InboxEntry) and parsed.priority is Priority.BULK  # written before priorities
    parsed = parse_inbox_entry(b"1-0", {**fields, b"priority": b"interactive"})
    assert isinstance(parsed, InboxEntry) and parsed.priority is Priority.INTERACTIVE
    bad = parse_inbox_entry(b"1-0", {**fields, b"priority": b"urgent"})
    assert isinstance(bad, BadEntry) and "priority" in bad.reason and bad.reply_to == "r"


@pytest.mark.parametrize("bad", ["urgent", "", "BULK", 1, None, True])
async def test_a_bad_priority_is_refused_and_creates_nothing(fleet: FleetClient, workers: WorkerPool,
                                                             bad: object) -> None:
    await workers.add(NullEngine())
    with pytest.raises(InvalidRequestError, match="priority must be one of interactive, bulk"):
        await fleet.create_session(model=MODEL, mode=MODE, priority=bad)  # type: ignore[arg-type]
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0
    assert await fleet.redis.exists(fleet.keys.trainer_open) == 0


async def test_the_priority_is_stored_carried_by_each_step_and_shown(fleet: FleetClient,
                                                                     workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model=MODEL, mode=MODE, priority="interactive")
    plain = await fleet.create_session(model=MODEL, mode=MODE)
    assert await fleet.redis.hget(fleet.keys.session(s.session_id), "priority") == b"interactive"
    assert await fleet.redis.hget(fleet.keys.session(plain.session_id), "priority") == b"bulk"
    assert (await s.step(0, **world_step(0))).ok and (await plain.step(0, **world_step(0))).ok
    rows = {r.session_id: r for r in await list_sessions(fleet.redis, fleet.keys)}
    assert (rows[s.session_id].priority, rows[plain.session_id].priority) == ("interactive", "bulk")
    assert rows[s.session_id].trainer == fleet.trainer == fleet.client_id
