"""The core step path against a real Redis with in-process workers (null engine: fast, no torch)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from broker import FleetClient
from schemas.errors import CapacityExhaustedError, ErrorCode, InvalidRequestError
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


async def test_world_step_commits_and_returns_a_latent(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **world_step(0))
    assert r.ok, r.error
    assert (r.step_id, r.committed_step_id, r.context_length) == (0, 0, 1)
    assert isinstance(r.output["video_latent"], np.ndarray)
    assert r.latency.total_ms > 0 and r.worker_id == s.owner
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id, st.closed) == (0, 1, False)


async def test_step_id_rules(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=1)
    assert (await s.step(0, **world_step(0))).ok
    r = await s.step(2, **world_step(2))
    assert r.error and r.error.code is ErrorCode.STEP_OUT_OF_ORDER and r.committed_step_id == 0
    assert (await s.step(1, **world_step(1))).ok
    # step 0 fell out of the stored window of 1: a plain step_already_committed
    r = await s.step(0, **world_step(0))
    assert r.error and r.error.code is ErrorCode.STEP_ALREADY_COMMITTED and r.committed_step_id == 1


async def test_resending_a_committed_step_returns_its_stored_result(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=4)
    first = await s.step(0, **world_step(0))
    assert (await s.step(1, **world_step(1))).ok
    again = await s.step(0, **world_step(0))
    assert again.ok and again.duplicate and again.step_id == 0
    assert again.committed_step_id == 1
    assert np.array_equal(again.output["video_latent"], first.output["video_latent"])
    assert (await s.status()).committed_step_id == 1


async def test_failure_never_advances_the_commit_and_the_step_can_be_retried(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine(), max_attempts=2, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    r = await s.step(1, **world_step(1, prompt="fail"))
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR
    assert r.committed_step_id == 0 and r.attempt == 2
    assert (await s.status()).committed_step_id == 0
    r = await s.step(1, **world_step(1))
    assert r.ok and r.committed_step_id == 1 and r.output["context"] == 1


async def test_invalid_input_in_the_engine_is_not_retried(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), max_attempts=3, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **world_step(0, prompt="invalid"))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and r.attempt == 1
    assert (await s.step(0, **world_step(0))).ok


async def test_pipelined_steps_of_one_session_run_in_order(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    results = await asyncio.gather(*[s.submit(i, **world_step(i)) for i in range(30)])
    assert [r.step_id for r in results] == list(range(30))
    assert all(r.ok for r in results)
    # the null engine counts the steps its context has seen: each ran once, in order
    assert [r.output["context"] for r in results] == list(range(30))


async def test_a_failure_cancels_the_pipelined_steps_behind_it(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), max_attempts=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    futs = [s.submit(0, **world_step(0)), s.submit(1, **world_step(1, prompt="fail")),
            s.submit(2, **world_step(2)), s.submit(3, **world_step(3))]
    r0, r1, r2, r3 = await asyncio.gather(*futs)
    assert r0.ok and r1.error and r1.error.code is ErrorCode.INFERENCE_ERROR
    assert r2.error and r2.error.code is ErrorCode.STEP_OUT_OF_ORDER
    assert r3.error and r3.error.code is ErrorCode.STEP_OUT_OF_ORDER
    retried = await asyncio.gather(*[s.submit(i, **world_step(i)) for i in (1, 2, 3)])
    assert [r.ok for r in retried] == [True, True, True]
    assert [r.output["context"] for r in retried] == [1, 2, 3]


async def test_many_sessions_on_two_workers_stay_on_their_owner(fleet: FleetClient, workers: WorkerPool) -> None:
    w1 = await workers.add(NullEngine())
    w2 = await workers.add(NullEngine())
    sessions = [await fleet.create_session(model="null-lm", mode="tokens") for _ in range(16)]
    owners = {s.owner for s in sessions}
    assert owners == {w1.id, w2.id}  # least loaded placement spreads them

    async def run(s):  # type: ignore[no-untyped-def]
        return await asyncio.gather(*[s.submit(i, token_ids=[i, i + 1]) for i in range(10)])

    all_results = await asyncio.gather(*[run(s) for s in sessions])
    for s, results in zip(sessions, all_results, strict=True):
        assert all(r.ok for r in results)
        assert {r.worker_id for r in results} == {s.owner}
        assert [r.output["context"] for r in results] == [4 * i for i in range(10)]  # 2 ids in, 2 out a step


async def test_reset_starts_the_session_over(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(3):
        assert (await s.step(i, **world_step(i))).ok
    assert await s.reset() == -1
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id, st.context_length) == (-1, 0, 0)
    fresh = await (await fleet.create_session(model="null-world", mode="world_model_env")).step(0, **world_step(0))
    r = await s.step(0, **world_step(0))
    assert r.ok and r.committed_step_id == 0
    assert np.array_equal(r.output["video_latent"], fresh.output["video_latent"])


async def test_reset_keeps_order_with_queued_steps(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    before = [s.submit(i, **world_step(i)) for i in range(3)]
    reset = asyncio.ensure_future(s.reset())
    after = [s.submit(i, **world_step(i)) for i in range(2)]
    results = await asyncio.gather(*before)
    assert [r.output["context"] for r in results] == [0, 1, 2]
    assert await reset == -1
    results = await asyncio.gather(*after)
    assert [(r.ok, r.output["context"]) for r in results] == [(True, 0), (True, 1)]
    assert (await s.status()).committed_step_id == 1


async def test_close_twice_and_steps_after_close(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    await s.close()
    await s.close()
    r = await s.step(1, **world_step(1))
    assert r.error and r.error.code is ErrorCode.SESSION_CLOSED and r.committed_step_id == 0
    assert (await s.status()).closed


async def test_stateless_step_runs_from_a_fresh_context_and_commits_nothing(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(2):
        assert (await s.step(i, **world_step(i))).ok
    r = await s.step(99, use_session_context=False, **world_step(0))
    assert r.ok and r.step_id == 99 and r.output["context"] == 0
    st = await s.status()
    assert (st.committed_step_id, st.next_step_id) == (1, 2)
    assert (await s.step(2, **world_step(2))).output["context"] == 2  # session context untouched


async def test_unknown_session(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    s.session_id = "nope"
    r = await s.step(0, **world_step(0))
    assert r.error and r.error.code is ErrorCode.SESSION_NOT_FOUND


async def test_unknown_mode_model_and_no_capacity(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), capacity=1)
    with pytest.raises(InvalidRequestError, match="unknown mode"):
        await fleet.create_session(model="null-world", mode="video")
    with pytest.raises(InvalidRequestError, match="unknown model"):
        await fleet.create_session(model="gpt-9", mode="tokens")
    await fleet.create_session(model="null-world", mode="world_model_env")
    with pytest.raises(CapacityExhaustedError):
        await fleet.create_session(model="null-world", mode="world_model_env")


async def test_closing_frees_capacity(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), capacity=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    await s.close()
    for _ in range(50):  # the owner applies the close asynchronously
        try:
            await fleet.create_session(model="null-world", mode="world_model_env")
            return
        except CapacityExhaustedError:
            await asyncio.sleep(0.05)
    pytest.fail("capacity was not freed by close")
