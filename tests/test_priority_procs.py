"""Priorities on a worker process (the CLI): on a busy worker an interactive session's step runs
ahead of the bulk steps queued before it; a bulk one waits its turn. The proof is the order of
the batches the engine records (tests/ordering_engine.py), never a time: a held batch keeps the
engine busy while the test queues steps, and the worker's heartbeat tells when they are queued."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from tests.ordering_engine import HOLD_PROMPT
from tests.procs import Fleet
from tests.support import until, world_step

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
MODEL, MODE = "null-world", "world_model_env"
CAPACITY = 16  # the heartbeat's pressure is running jobs / CAPACITY (the engine reports no load)
WAIT_S = 60.0  # every wait of these tests is bounded by this


@pytest.fixture
def fleet_procs(redis_server: RedisServer, prefix: str) -> Iterator[Fleet]:
    procs = Fleet(redis_server.url, prefix)
    yield procs
    procs.close()


async def running_jobs(fleet: FleetClient, worker_id: str) -> int:
    """The jobs the worker has read and not finished, as its last heartbeat published them."""
    raw = await fleet.redis.hget(fleet.keys.pressure, worker_id)
    return -1 if raw is None else round(float(raw) * CAPACITY)


@pytest.mark.parametrize("priority", ["interactive", "bulk"])
async def test_an_interactive_step_runs_ahead_of_bulk_steps_queued_before_it_on_a_worker_process(
        fleet_procs: Fleet, tmp_path: Path, priority: str) -> None:
    record, held, go = tmp_path / "batches.jsonl", tmp_path / "held", tmp_path / "go"
    options = {"max_batch": 2, "record_path": record, "held_path": held, "go_path": go}
    fleet_procs.worker("--capacity", str(CAPACITY), *[f"--engine-opt={k}={v}" for k, v in options.items()],
                       engine="tests.ordering_engine:OrderingEngine")
    [worker_id] = await fleet_procs.wait_active(1)
    async with FleetClient(fleet_procs.url, prefix=fleet_procs.prefix) as fleet:
        blocker = await fleet.create_session(model=MODEL, mode=MODE)
        bulk = [await fleet.create_session(model=MODEL, mode=MODE) for _ in range(6)]
        late = await fleet.create_session(model=MODEL, mode=MODE, priority=priority)

        async def running(n: int) -> bool:
            return await running_jobs(fleet, worker_id) == n

        # Step 0 of each first: the worker then knows every session, so a step it reads goes
        # straight to the batcher (no read of the session record in between).
        for s in (blocker, *bulk, late):
            assert (await s.step(0, **world_step(0))).ok
        await until(lambda: running(0), "the first steps finishing", WAIT_S, 0.02)
        # The blocker's step holds the engine; what comes next queues behind it.
        futs = [blocker.submit(1, **world_step(1, prompt=HOLD_PROMPT))]
        await until(lambda: asyncio.to_thread(held.exists), "the blocker's batch holding", WAIT_S, 0.02)
        await until(lambda: running(1), "the blocker running alone", WAIT_S, 0.02)
        futs += [s.submit(1, **world_step(1)) for s in bulk]
        await until(lambda: running(7), "the bulk steps queueing", WAIT_S, 0.02)
        futs.append(late.submit(1, **world_step(1)))
        await until(lambda: running(8), "the late step queueing", WAIT_S, 0.02)
        go.touch()  # every batch may run now: the order is the worker's alone
        results = await asyncio.wait_for(asyncio.gather(*futs), WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results]
    batches = [json.loads(line) for line in record.read_text().splitlines()]
    start = max(i for i, batch in enumerate(batches) if blocker.session_id in batch)
    assert batches[start] == [blocker.session_id]  # the held batch: the blocker's step 1 alone
    after = batches[start + 1:]
    order = [sid for batch in after for sid in batch]
    assert sorted(order) == sorted([late.session_id, *(s.session_id for s in bulk)])
    assert all(len(batch) <= 2 for batch in after)
    if priority == "interactive":  # first of the next batch, ahead of the six bulk steps queued before it
        assert after[0][0] == late.session_id
    else:  # bulk waits behind them (the test tells the two apart)
        assert order[-1] == late.session_id
