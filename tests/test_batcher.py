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
