"""The batcher: requests that arrive while the engine is busy form the next batch, up to its cap;
each request gets its own output or error; a failed batch fails every request in it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from schemas.limits import DEFAULT_LIMITS
from schemas.messages import Mode, parse_step_input
from tests.support import world_step
from workers.batcher import Batcher
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine, NullEngineConfig

MODEL = "null-world"


def request(session: str, prompt: str = "pick the cup") -> EngineRequest:
    step = parse_step_input(Mode.WORLD_MODEL_ENV, world_step(0, prompt=prompt), DEFAULT_LIMITS)
    return EngineRequest(session_key=session, model=MODEL, step=step)


async def test_requests_that_arrive_while_the_engine_is_busy_form_the_next_batch() -> None:
    engine = NullEngine(NullEngineConfig(delay_ms=100))
    batcher = Batcher(engine, MODEL, max_batch=8)
    try:
        first = asyncio.create_task(batcher.run(request("s0")))
        await asyncio.sleep(0.03)  # the first batch (of one) is in the engine now
        rest = [asyncio.create_task(batcher.run(request(f"s{i}"))) for i in range(1, 11)]
        outs = await asyncio.gather(first, *rest)
    finally:
        await batcher.close()
    assert engine.batch_sizes == [1, 8, 2]  # 10 waiting requests, at most 8 a batch, in arrival order
    assert all(isinstance(out, EngineOutput) for out in outs)
    assert (batcher.batches, batcher.items) == (3, 11)


async def test_an_error_for_one_request_reaches_only_that_request() -> None:
    batcher = Batcher(NullEngine(), MODEL, max_batch=8)
    try:
        outs = await asyncio.gather(batcher.run(request("a")), batcher.run(request("b", prompt="fail")),
                                    batcher.run(request("c")), return_exceptions=True)
    finally:
        await batcher.close()
    assert isinstance(outs[0], EngineOutput) and isinstance(outs[2], EngineOutput)
    assert isinstance(outs[1], RuntimeError) and "asked to fail" in str(outs[1])


class BrokenEngine(NullEngine):
    """Answers a batch with the wrong number of outputs, or raises for the whole batch."""

    def __init__(self, *, raise_error: bool) -> None:
        super().__init__()
        self.raise_error = raise_error

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        if self.raise_error:
            raise ConnectionError("the engine's server went away")
        return (await super().run_batch(model, requests))[:-1]


@pytest.mark.parametrize(("raise_error", "expected"), [(True, ConnectionError), (False, RuntimeError)])
async def test_a_failed_batch_fails_every_request_in_it(raise_error: bool, expected: type[Exception]) -> None:
    batcher = Batcher(BrokenEngine(raise_error=raise_error), MODEL, max_batch=8)
    try:
        outs = await asyncio.gather(*(batcher.run(request(f"s{i}")) for i in range(3)), return_exceptions=True)
    finally:
        await batcher.close()
    assert [type(out) for out in outs] == [expected] * 3


async def test_a_request_whose_caller_gave_up_is_left_out_of_the_batch() -> None:
    engine = NullEngine(NullEngineConfig(delay_ms=100))
    batcher = Batcher(engine, MODEL, max_batch=8)
    try:
        busy = asyncio.create_task(batcher.run(request("busy")))
        await asyncio.sleep(0.03)
        gone = asyncio.create_task(batcher.run(request("gone")))
        kept = asyncio.create_task(batcher.run(request("kept")))
        await asyncio.sleep(0)
        gone.cancel()
        out = await kept
        await busy
    finally:
        await batcher.close()
    assert isinstance(out, EngineOutput)
    assert engine.batch_sizes == [1, 1]  # the cancelled request never reached the engine


class HeldEngine(NullEngine):
    """Holds every batch until released, counting the batches inside run_batch at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.inside = 0
        self.most_inside = 0

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            await asyncio.wait_for(self.release.wait(), 10)
            return await super().run_batch(model, requests)
        finally:
            self.inside -= 1


@pytest.mark.parametrize("in_flight", [1, 2])
async def test_an_engine_that_batches_on_its_own_gets_several_batches_at_once(in_flight: int) -> None:
    engine = HeldEngine()
    batcher = Batcher(engine, MODEL, max_batch=2, in_flight=in_flight)
    try:
        tasks = [asyncio.create_task(batcher.run(request(f"s{i}"))) for i in range(6)]
        for _ in range(100):  # bounded: until the batcher has handed over all it may
            await asyncio.sleep(0.01)
            if engine.inside == in_flight:
                break
        await asyncio.sleep(0.05)  # time for a batch beyond the bound to (wrongly) start
        assert engine.most_inside == in_flight
        assert batcher.waiting() == 6 - 2 * in_flight
        engine.release.set()
        outs = await asyncio.gather(*tasks)
    finally:
        await batcher.close()
    assert all(isinstance(out, EngineOutput) for out in outs)
    assert batcher.items == 6


def test_batches_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Batcher(NullEngine(), MODEL, max_batch=2, in_flight=0)


class RecordingEngine(NullEngine):
    """Records when each batch reaches the engine, beside the answers the test's lanes record."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(NullEngineConfig(delay_ms=10))
        self.events = events

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.events.append("start " + ",".join(r.session_key for r in requests))
        return await super().run_batch(model, requests)


async def test_the_next_full_batch_reaches_the_engine_before_the_last_one_is_answered() -> None:
    """A device that runs one forward at a time must not idle while the event loop does the
    finished batch's commit work: the next batch, already waiting and full, starts first."""
    events: list[str] = []
    batcher = Batcher(RecordingEngine(events), MODEL, max_batch=2)

    async def lane(session: str) -> None:
        await batcher.run(request(session))
        events.append("answered " + session)

    try:
        await asyncio.gather(*(lane(s) for s in ("a", "b", "c", "d", "e", "f")))
    finally:
        await batcher.close()
    assert events == ["start a,b", "start c,d", "answered a", "answered b",
                      "start e,f", "answered c", "answered d", "answered e", "answered f"]
