"""Worker loss: lease expiry, failover with jobs in order, context rebuild, drain handover."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from broker import FleetClient
from broker.ops.failover import reap
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode, FleetError
from tests.support import FAST, WorkerPool, reap_until_moved, world_step
from workers.engines.null import NullEngine, NullEngineConfig
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

pytestmark = pytest.mark.asyncio
SHAPE = (1, 4, 2, 8, 10)



def ref() -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE))


async def test_sessions_of_a_dead_worker_continue_on_a_live_one_with_the_same_results(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    a = await workers.add(ref(), **FAST)
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    t = await fleet.create_session(model="reference-lm", mode="tokens")
    assert s.owner == t.owner == a.id
    b = await workers.add(ref(), **FAST)
    control = await fleet.create_session(model="reference-world", mode="world_model_env")  # lands on b
    ctl_t = await fleet.create_session(model="reference-lm", mode="tokens")
    assert control.owner == ctl_t.owner == b.id
    tok = {"token_ids": [1, 2, 3], "sampling": {"max_tokens": 6, "seed": 3}}
    for i in range(3):
        assert (await s.step(i, **world_step(i))).ok and (await control.step(i, **world_step(i))).ok
        assert (await t.step(i, **tok)).ok and (await ctl_t.step(i, **tok)).ok
    await workers.kill(a)
    await reap_until_moved(scripts, a.id)
    r, c = await asyncio.gather(s.step(3, **world_step(3)), control.step(3, **world_step(3)))
    assert r.ok and r.worker_id == b.id and s.owner == b.id
    assert np.array_equal(r.output["video_latent"], c.output["video_latent"])  # context rebuilt exactly
    rt, ct = await asyncio.gather(t.step(3, **tok), ctl_t.step(3, **tok))
    assert rt.ok and rt.output["token_ids"] == ct.output["token_ids"] and rt.output["logprobs"] == ct.output["logprobs"]
    assert (await s.status()).epoch == 2
    assert b.worker.executor.rebuilt_steps == 6


async def test_queued_jobs_move_in_order_and_nothing_runs_twice(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    a = await workers.add(NullEngine(NullEngineConfig(delay_ms=200)), **FAST)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    futs = [s.submit(i, **world_step(i)) for i in range(8)]
    await asyncio.sleep(0.1)  # a has read step 0 and is inside the engine
    await workers.kill(a)
    b = await workers.add(NullEngine(), **FAST)
    await reap_until_moved(scripts, a.id)
    results = await asyncio.wait_for(asyncio.gather(*futs), 20)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output["context"] for r in results] == list(range(8))
    assert {r.worker_id for r in results} == {b.id}
    assert (await s.status()).committed_step_id == 7


async def test_a_token_session_of_a_dead_null_worker_is_rebuilt_by_one_prefill_and_goes_on(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    """The null engine counts a token session's context in tokens, as a real engine does: the new
    owner's one prefill of the recorded ids holds what the committed step left, so the session goes
    on where it was (no ``context_lost``), with one engine request for the rebuild."""
    a = await workers.add(NullEngine(), **FAST)
    t = await fleet.create_session(model="null-lm", mode="tokens")
    for i in range(4):  # 2 ids in, the same 2 out: 4 tokens a step
        r = await t.step(i, token_ids=[7, i])
        assert r.ok and r.output["context"] == 4 * i and r.context_length == 4 * (i + 1)
    await workers.kill(a)
    b = await workers.add(NullEngine(), **FAST)
    await reap_until_moved(scripts, a.id)
    r = await t.step(4, token_ids=[7, 4])
    assert r.ok and r.worker_id == b.id, r.error
    assert r.output["context"] == 16 and r.context_length == 20
    executor = b.worker.executor
    assert (executor.rebuilt_steps, executor.rebuild_engine_calls, executor.replayed_steps) == (4, 1, 0)


async def test_world_session_without_retained_inputs_reports_context_lost(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    a = await workers.add(ref(), **FAST)
    s = await fleet.create_session(model="reference-world", mode="world_model_env", retention="none")
    kept = await fleet.create_session(model="reference-world", mode="world_model_env", retention="last:2")
    for i in range(3):
        assert (await s.step(i, **world_step(i))).ok and (await kept.step(i, **world_step(i))).ok
    await workers.add(ref(), **FAST)
    await workers.kill(a)
    await reap_until_moved(scripts, a.id)
    r = await s.step(3, **world_step(3))
    assert r.error and r.error.code is ErrorCode.CONTEXT_LOST and r.committed_step_id == 2
    r = await kept.step(3, **world_step(3))  # last:2 of 3 steps cannot rebuild either
    assert r.error and r.error.code is ErrorCode.CONTEXT_LOST
    assert await s.reset() == -1
    assert (await s.step(0, **world_step(0))).ok


async def test_a_live_worker_with_a_long_step_is_never_taken_over(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    a = await workers.add(NullEngine(NullEngineConfig(delay_ms=1500)), **FAST)  # 3 leases long
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    await workers.add(NullEngine(), **FAST)
    assert s.owner == a.id
    fut = s.submit(0, **world_step(0))
    for _ in range(10):
        assert all(not r.moved for r in await reap(scripts, lease_ms=FAST["lease_ms"]))
        await asyncio.sleep(0.1)
    r = await fut
    assert r.ok and r.worker_id == a.id and (await s.status()).epoch == 1


async def test_drain_hands_sessions_over_without_waiting_for_the_lease(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    a = await workers.add(NullEngine(NullEngineConfig(delay_ms=50)), lease_ms=60_000)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(4)]
    b = await workers.add(NullEngine(), lease_ms=60_000)
    futs = [[s.submit(i, **world_step(i)) for i in range(5)] for s in sessions]
    await asyncio.sleep(0.05)
    await workers.stop(a)  # SIGTERM path: finish in-flight, hand over, exit
    for s, fs in zip(sessions, futs, strict=True):
        results = await asyncio.wait_for(asyncio.gather(*fs), 10)
        assert all(r.ok for r in results), [r.error for r in results]
        assert [r.output["context"] for r in results] == list(range(5))
        more = await s.step(5, **world_step(5))
        assert more.ok and more.worker_id == b.id
    assert await fleet.redis.zscore(fleet.keys.workers, a.id) is None  # retired at once


class ContextLosingEngine(NullEngine):
    """Forgets every context once when told to, and says so (a remote server that restarted)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = False

    async def run_batch(self, model: str, requests):  # type: ignore[no-untyped-def]
        if self.lose:
            self.lose = False
            self._contexts.clear()
            return [FleetError("the server no longer has this session", code=ErrorCode.CONTEXT_LOST)
                    for _ in requests]
        return await super().run_batch(model, requests)


async def test_an_engine_that_lost_a_context_gets_it_rebuilt_from_the_log(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    engine = ContextLosingEngine()
    w = await workers.add(engine, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(4):
        assert (await s.step(i, **world_step(i))).ok
    engine.lose = True
    r = await s.step(4, **world_step(4))
    assert r.ok and r.output["context"] == 4 and r.attempt == 2
    assert w.worker.executor.rebuilt_steps == 4


async def test_a_close_applied_after_a_worker_left_its_pools_does_not_put_it_back(
        fleet: FleetClient, workers: WorkerPool) -> None:
    """A draining (or not ready) worker has left the placement pools; a close it then applies must
    not re-add it with a score of -1, where it would look like the least-loaded worker."""
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    pool = fleet.keys.pool("world_model_env", "null-world")
    await fleet.scripts.leave_pools(w.id, pools=[pool], state="draining")
    await s.close()
    deadline = asyncio.get_running_loop().time() + 10
    while await fleet.redis.hexists(fleet.keys.sessions, s.session_id):
        assert asyncio.get_running_loop().time() < deadline, "the close was not applied"
        await asyncio.sleep(0.05)
    assert await fleet.redis.zscore(pool, w.id) is None
