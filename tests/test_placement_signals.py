"""What a worker tells placement: engine pressure from its load signals, and the per-model split."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from broker.redis.keys import CellKeys
from schemas.errors import StepAborted
from schemas.messages import Mode, parse_step_input
from tests.support import world_step
from workers.engines.base import AbortableCalls, EngineLoad, EngineRequest
from workers.engines.null import NullEngine, NullEngineConfig
from workers.placement import pool_caps, pressure


def test_pressure_is_the_larger_of_memory_use_and_running_steps_over_capacity() -> None:
    assert pressure(EngineLoad(running_steps=2, memory_use=0.1), running_jobs=9, capacity=8) == 0.25
    assert pressure(EngineLoad(running_steps=2, memory_use=0.7), running_jobs=0, capacity=8) == 0.7
    # an engine that does not count its steps is measured by the worker's running jobs
    assert pressure(EngineLoad(), running_jobs=4, capacity=8) == 0.5
    assert pressure(EngineLoad(running_steps=50, memory_use=3.0), running_jobs=0, capacity=8) == 1.0
    assert pressure(EngineLoad(memory_use=-1.0), running_jobs=0, capacity=8) == 0.0


class SplitEngine(NullEngine):
    def capacity_split(self, capacity: int) -> Mapping[str, int]:
        return {"null-lm": 3, "null-world": capacity * 2, "not-served": 1}


def test_pool_caps_name_served_pools_and_stay_within_the_capacity() -> None:
    keys = CellKeys("p")
    assert pool_caps(SplitEngine(), keys, 8) == {keys.pool("tokens", "null-lm"): 3,
                                                 keys.pool("world_model_env", "null-world"): 8}
    assert pool_caps(NullEngine(), keys, 8) == {}


async def test_engines_count_their_running_calls() -> None:
    calls = AbortableCalls()
    release = asyncio.Event()
    running = [asyncio.create_task(calls.run(release.wait())) for _ in range(3)]
    for _ in range(100):  # bounded: each task registers its call on its first turn
        if calls.running() == 3:
            break
        await asyncio.sleep(0)
    assert calls.running() == 3
    release.set()
    await asyncio.gather(*running)
    assert calls.running() == 0


async def test_the_null_engine_reports_the_requests_inside_it() -> None:
    engine = NullEngine(NullEngineConfig(delay_ms=600_000))  # until aborted below
    step = parse_step_input(Mode.WORLD_MODEL_ENV, world_step(0))
    batch = asyncio.create_task(engine.run_batch("null-world", [EngineRequest("s", "null-world", step)] * 2))
    for _ in range(500):  # bounded: the task enters the engine within a few loop turns
        if engine.load().running_steps:
            break
        await asyncio.sleep(0.01)
    assert engine.load() == EngineLoad(running_steps=2)
    await engine.abort_running()
    assert all(isinstance(r, StepAborted) for r in await batch)
    assert engine.load() == EngineLoad(running_steps=0)
