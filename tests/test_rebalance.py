"""Rebalancing: a worker that joins a busy one takes sessions from it at step boundaries, and the
trainer sees every step committed once, in order, with no error."""

from __future__ import annotations

import asyncio

import pytest

from broker import FleetClient
from broker.client.session import Session
from broker.ops.failover import Candidate
from broker.redis.scripts import Scripts
from tests.support import FAST, RunningWorker, WorkerPool, world_step
from workers.engines.null import NullEngine, NullEngineConfig
from workers.rebalance import Rebalancer, worth_moving

SESSIONS, STEPS = 8, 30
MAX_STEPS = 3000  # a bound on how long trainers keep stepping while they wait for the move
REBALANCE = {"rebalance_interval_s": 0.2, "rebalance_threshold": 0.25, "capacity": 8}


async def _run(session: Session, owners: set[str],
               moved: asyncio.Event | None = None) -> list[tuple[int, int, int, bool]]:
    """Step closed-loop; (step, committed, context, ok) per step, and every owner seen. With
    ``moved``: go on past STEPS until it is set (at most MAX_STEPS), so that a loaded machine
    where the move comes late still sees steps after it."""
    out = []
    i = 0
    while i < STEPS or (moved is not None and not moved.is_set() and i < MAX_STEPS):
        r = await session.step(i, **world_step(i))
        out.append((i, r.committed_step_id, int(r.output["context"]) if r.ok else -1, r.ok))
        owners.add(r.worker_id)
        if not r.ok:
            pytest.fail(f"step {i} of {session.session_id} failed: {r.error}")
        i += 1
    return out


async def test_a_new_worker_takes_sessions_from_a_busy_one_without_an_error(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    engine = NullEngineConfig(delay_ms=5)
    busy = await workers.add(NullEngine(engine), **FAST, **REBALANCE)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(SESSIONS)]
    assert {s.owner for s in sessions} == {busy.id}
    owners: set[str] = set()
    moved_seen = asyncio.Event()
    runs = [asyncio.create_task(_run(s, owners, moved_seen)) for s in sessions]
    for _ in range(1000):  # bounded: the trainers are stepping on the busy worker within a few batches
        if owners:
            break
        await asyncio.sleep(0.02)
    assert owners == {busy.id}
    fresh = await workers.add(NullEngine(engine), **FAST, **REBALANCE)
    for _ in range(3000):  # bounded: until a trainer has a step served by the new worker
        if fresh.id in owners or all(run.done() for run in runs):
            break
        await asyncio.sleep(0.02)
    moved_seen.set()
    results = await asyncio.wait_for(asyncio.gather(*runs), 120)

    # every step committed once and in order: the null engine's context counts the steps it has
    # seen for the session, so a step lost, repeated or reordered by a move would show here
    for steps in results:
        assert steps == [(i, i, i, True) for i in range(len(steps))] and len(steps) >= STEPS
    # The busy worker goes on rebalancing in the background (the trainers are done, so every session
    # is between steps), so its counter and the owned counts are read between two reads of the
    # epochs: each session that left it raised its epoch, and each move raised one epoch by one.
    before = [(await s.status()).epoch for s in sessions]
    rebalanced = busy.worker.metrics.fleet.registry.get_sample_value("rollout_fleet_rebalanced_total")
    owned = {w: int(await scripts.redis.hget(scripts.keys.owned, w) or 0) for w in (busy.id, fresh.id)}
    after = [(await s.status()).epoch for s in sessions]
    moved = sum(epoch > 1 for epoch in before)
    assert moved and fresh.id in owners
    assert fresh.worker.executor.rebuilt_steps > 0  # the new owner rebuilt the moved contexts first
    assert rebalanced is not None and moved <= rebalanced <= sum(epoch - 1 for epoch in after)
    assert sum(owned.values()) == SESSIONS and moved <= owned[fresh.id] <= sum(epoch > 1 for epoch in after)


def _rebalancer(running: RunningWorker) -> Rebalancer:
    """A pass of the worker's own rebalancing, to call directly (no timing involved)."""
    w = running.worker
    assert w._scripts is not None
    return Rebalancer(w._scripts, lambda: w.id, w._movable, w._forget, lambda: True, 1.0, 0.25,
                      FAST["lease_ms"], w.metrics.fleet)


async def test_balanced_workers_move_nothing_and_a_busy_one_moves_to_balance(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    a = await workers.add(NullEngine(), **FAST, capacity=4)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(4)]
    for s in sessions:  # the worker knows its sessions once it has run a step of each
        assert (await s.step(0, **world_step(0))).ok
    b = await workers.add(NullEngine(), **FAST, capacity=4)
    assert await _rebalancer(b).pass_once() == 0  # b owns nothing: nothing to give
    assert await _rebalancer(a).pass_once() == 2  # 4/4 vs 0/4: two moves make it 2/4 vs 2/4
    assert await _rebalancer(a).pass_once() == 0  # balanced now
    assert await _rebalancer(b).pass_once() == 0
    owners = [(await s.status()).owner for s in sessions]
    assert owners.count(a.id) == owners.count(b.id) == 2
    for s in sessions:  # every session goes on where it is, the moved ones rebuilt
        r = await s.step(1, **world_step(1))
        assert r.ok and r.output["context"] == 1


def test_a_move_never_leaves_the_target_busier() -> None:
    target = Candidate("t", owned=3, capacity=4, pressure=0.0)
    assert not worth_moving(4, 4, target, 0.1)  # 3/4 vs 4/4 would just swap
    assert worth_moving(4, 4, Candidate("t", owned=1, capacity=4, pressure=0.0), 0.25)
    assert not worth_moving(3, 8, Candidate("t", owned=1, capacity=8, pressure=0.0), 0.25)  # 2/8: within
