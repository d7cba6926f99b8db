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
from schemas.sharing import Priority
from tests.support import WorkerPool, world_step
from tests.test_batcher import request
from workers.batcher import Batcher
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine
from workers.read_order import interactive_first

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


def entry(sid: str, kind: str = "step", priority: str | None = None) -> tuple[bytes, dict[bytes, bytes]]:
    fields = {b"kind": kind.encode(), b"session_id": sid.encode()}
    if priority is not None:
        fields[b"priority"] = priority.encode()
    return (f"{sid}-{kind}".encode(), fields)


def test_a_read_hands_interactive_sessions_first_and_keeps_each_sessions_order() -> None:
    entries = [entry("a", priority="bulk"), entry("b", "reset"), entry("b", priority="interactive"),
               entry("a", "close"), entry("c", priority="interactive"), entry("gone")]
    entries.append((b"deleted", {}))  # an entry deleted while pending: no fields at all
    ordered = [eid for eid, _ in interactive_first(entries)]
    # b's reset carries no class but belongs to an interactive session: it stays ahead of b's step.
    assert ordered == [b"b-reset", b"b-step", b"c-step", b"a-step", b"a-close", b"gone-step", b"deleted"]


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
