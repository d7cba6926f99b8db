"""The executor's failure path and its shielded commits, against a real Redis.

The worker under test is started but does not read its inbox: each test takes the job the trainer
enqueued from the inbox and runs it through the worker's one answering path (``_guard``), so every
failure kind is seen as the trainer sees it: one error result, the fallback, the dead letter."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from broker import FleetClient
from broker.client import Session
from broker.redis.aio import HeldFuture, outcome_of
from broker.redis.embedded import RedisServer
from broker.redis.inbox import InboxEntry, parse_inbox_entry
from broker.redis.scripts import Scripts
from schemas.errors import ContextLost, ErrorCode, InferenceError, TransientEngineError
from schemas.messages import StepResult
from tests.support import world_step
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine
from workers.job_scripts import CommitAnswer, finish_before_cancel, settled_in_place
from workers.settings import WorkerSettings
from workers.worker import Worker


class FailingEngine(NullEngine):
    """Answers every run with ``error`` (a fresh one per request)."""

    def __init__(self, error: Callable[[], BaseException]) -> None:
        super().__init__()
        self.error = error
        self.runs = 0

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.runs += len(requests)
        return [self.error() for _ in requests]


StartWorker = Callable[[NullEngine], Awaitable[Worker]]


@pytest.fixture
async def start_worker(redis_server: RedisServer, prefix: str) -> AsyncIterator[StartWorker]:
    """Start a registered worker on an engine; it reads nothing from its inbox."""
    started: list[Worker] = []

    async def start(engine: NullEngine) -> Worker:
        worker = Worker(engine, WorkerSettings.from_mapping(
            {"redis_url": redis_server.url, "prefix": prefix, "max_attempts": 2, "retry_backoff_ms": 1}))
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        await worker.shutdown()


@pytest.fixture
async def idle_worker(start_worker: StartWorker) -> Worker:
    return await start_worker(NullEngine())


async def enqueued(fleet: FleetClient, worker: Worker,
                   step_id: int) -> tuple[Session, asyncio.Task[StepResult], InboxEntry]:
    """Create a session on ``worker``, submit step ``step_id`` and take its job from the inbox."""
    session = await fleet.create_session(model="null-world", mode="world_model_env")
    waiting = session.submit(step_id, **world_step(step_id))
    for _ in range(200):
        entries = await fleet.redis.xrange(fleet.keys.inbox(worker.id))
        if entries:
            job = parse_inbox_entry(*entries[-1])
            assert isinstance(job, InboxEntry)
            return session, waiting, job
        await asyncio.sleep(0.01)
    pytest.fail("the step was not enqueued")


async def run(worker: Worker, job: InboxEntry) -> None:
    await worker._guard(job, worker._process(job))


async def answered(fleet: FleetClient, waiting: asyncio.Task[StepResult]) -> tuple[StepResult, int]:
    """The one result the trainer got, and how many jobs were dead-lettered."""
    result = await asyncio.wait_for(waiting, 5)
    return result, await fleet.redis.xlen(fleet.keys.dead)


async def test_bad_payload_fails_at_once_with_a_fallback_and_no_dead_letter(fleet: FleetClient,
                                                                            idle_worker: Worker) -> None:
    s, waiting, job = await enqueued(fleet, idle_worker, 0)
    await run(idle_worker, dataclasses.replace(job, payload=b"\xc1not msgpack"))
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and r.committed_step_id == -1 and dead == 0
    assert (await s.status()).next_step_id == 0  # the trainer may send step 0 again
    assert await fleet.redis.xlen(fleet.keys.inbox(idle_worker.id)) == 0


async def test_a_step_out_of_order_fails_without_a_fallback(fleet: FleetClient, idle_worker: Worker) -> None:
    s, waiting, job = await enqueued(fleet, idle_worker, 0)
    await run(idle_worker, dataclasses.replace(job, step_id=3))
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.STEP_OUT_OF_ORDER and "Expected step_id 0" in r.error.message
    assert dead == 0 and (await s.status()).next_step_id == 1  # nothing fell back


async def test_a_model_this_worker_does_not_serve_is_an_invalid_request(fleet: FleetClient,
                                                                       idle_worker: Worker) -> None:
    _, waiting, job = await enqueued(fleet, idle_worker, 0)
    await run(idle_worker, dataclasses.replace(job, model="elsewhere"))
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "elsewhere" in r.error.message and dead == 0


async def test_an_engine_error_is_answered_and_dead_lettered_without_a_retry(fleet: FleetClient,
                                                                            start_worker: StartWorker) -> None:
    worker = await start_worker(FailingEngine(lambda: InferenceError("the model blew up")))
    s, waiting, job = await enqueued(fleet, worker, 0)
    await run(worker, job)
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR and r.error.message == "the model blew up"
    assert r.attempt == 1 and dead == 1 and (await s.status()).next_step_id == 0
    assert worker.executor.failed_steps == 1


async def test_a_transient_error_is_retried_then_answered_and_dead_lettered(fleet: FleetClient,
                                                                           start_worker: StartWorker) -> None:
    worker = await start_worker(FailingEngine(lambda: TransientEngineError("server busy")))
    _, waiting, job = await enqueued(fleet, worker, 0)
    await run(worker, job)
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR and r.attempt == 2 and dead == 1
    assert r.error.message == "TransientEngineError: server busy"
    dead_entry = (await fleet.redis.xrange(fleet.keys.dead))[0][1]
    assert dead_entry[b"reason"] == b"inference_error: TransientEngineError: server busy"
    assert dead_entry[b"attempts"] == b"2"


async def test_a_context_the_engine_keeps_losing_fails_with_context_lost_and_no_dead_letter(
    fleet: FleetClient, start_worker: StartWorker
) -> None:
    worker = await start_worker(FailingEngine(lambda: ContextLost("the server forgot the session")))
    s, waiting, job = await enqueued(fleet, worker, 0)
    await run(worker, job)
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.CONTEXT_LOST and r.attempt == 2 and dead == 0
    assert (await s.status()).next_step_id == 0


async def test_a_bug_is_answered_as_an_internal_worker_error(fleet: FleetClient, idle_worker: Worker,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(job: InboxEntry) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(idle_worker.executor, "_parse", broken)
    s, waiting, job = await enqueued(fleet, idle_worker, 0)
    await run(idle_worker, job)
    r, dead = await answered(fleet, waiting)
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR and r.error.message == "internal worker error"
    assert dead == 0 and (await s.status()).next_step_id == 0


async def test_a_malformed_entry_takes_the_same_path(fleet: FleetClient, idle_worker: Worker) -> None:
    waiting = fleet.replies.expect("junk-1")
    fields = {b"kind": b"step", b"job_id": b"junk-1", b"reply_to": fleet.client_id.encode()}
    entry_id = await fleet.redis.xadd(fleet.keys.inbox(idle_worker.id), fields)  # type: ignore[arg-type]
    await idle_worker._inflight.acquire()
    idle_worker._dispatch(parse_inbox_entry(entry_id, fields))
    r = fleet.decode_result(await asyncio.wait_for(waiting, 5), 0.0)
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and "malformed job" in r.error.message
    dead = await fleet.redis.xrange(fleet.keys.dead)
    assert len(dead) == 1 and dead[0][1][b"reason"].startswith(b"invalid_request: missing field")
    assert await fleet.redis.xlen(fleet.keys.inbox(idle_worker.id)) == 0


async def test_a_commit_already_sent_completes_and_applies_its_outcome_when_the_lane_is_cancelled(
    fleet: FleetClient, idle_worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common commit (coalesced, no replica wait) runs in the lane's own task: a cancellation of
    the lane while the commit's answer is on its way (the flush task still reading it) waits for it."""
    assert idle_worker.executor.jobs.commits_in_place
    scripts = idle_worker.executor.jobs.scripts
    sent = asyncio.Event()
    real_direct = scripts._direct

    async def slow_answer(name: str, keys: list[str], args: list[Any], before: list[Any] | None = None) -> Any:
        answer = await real_direct(name, keys, args, before)
        if name == "commit":
            sent.set()
            await asyncio.sleep(0.2)  # the reply is still on its way when the lane is cancelled
        return answer

    monkeypatch.setattr(scripts, "_direct", slow_answer)
    s, waiting, job = await enqueued(fleet, idle_worker, 0)
    lane = asyncio.create_task(idle_worker._process(job))
    await sent.wait()
    lane.cancel()
    await asyncio.sleep(0.05)
    lane.cancel()  # a second cancellation does not cut the wait short either
    with pytest.raises(asyncio.CancelledError):
        await lane
    assert idle_worker._sessions[s.session_id].committed == 0 and idle_worker.executor.committed_steps == 1
    r = await asyncio.wait_for(waiting, 5)
    assert r.ok and r.committed_step_id == 0 and (await s.status()).committed_step_id == 0


async def test_a_commit_in_a_task_of_its_own_completes_and_applies_its_outcome_when_the_lane_is_cancelled(
    fleet: FleetClient, idle_worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that waits on the lane's own connection (replicated durability, no coalescing) runs
    in a task of its own (finish_before_cancel): there the whole call finishes first."""
    monkeypatch.setattr(idle_worker.executor.jobs, "commits_in_place", False)
    sent = asyncio.Event()
    real_commit = idle_worker.executor.jobs.commit

    async def slow_answer(job: InboxEntry, result: bytes, **kwargs: Any) -> tuple[CommitAnswer, int]:
        answer = await real_commit(job, result, **kwargs)
        sent.set()
        await asyncio.sleep(0.2)  # the reply is still on its way when the lane is cancelled
        return answer

    monkeypatch.setattr(idle_worker.executor.jobs, "commit", slow_answer)
    s, waiting, job = await enqueued(fleet, idle_worker, 0)
    lane = asyncio.create_task(idle_worker._process(job))
    await sent.wait()
    lane.cancel()
    with pytest.raises(asyncio.CancelledError):
        await lane
    assert idle_worker._sessions[s.session_id].committed == 0 and idle_worker.executor.committed_steps == 1
    r = await asyncio.wait_for(waiting, 5)
    assert r.ok and r.committed_step_id == 0 and (await s.status()).committed_step_id == 0


async def test_finish_before_cancel_lets_the_work_end_then_delivers_the_cancellation() -> None:
    done: list[str] = []

    async def work() -> str:
        await asyncio.sleep(0.05)
        done.append("applied")
        return "answer"

    caller = asyncio.create_task(finish_before_cancel(work()))
    await asyncio.sleep(0.01)
    caller.cancel()
    await asyncio.sleep(0)
    caller.cancel()  # a second cancellation does not cut the work short either
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert done == ["applied"]
    assert await finish_before_cancel(work()) == "answer"


async def test_outcome_of_waits_through_cancellations_and_keeps_them_requested() -> None:
    loop = asyncio.get_running_loop()
    fut: HeldFuture[str] = HeldFuture(loop=loop)
    after: list[str] = []

    async def caller() -> None:
        after.append(await outcome_of(fut))  # code between the outcome and the next await runs
        await asyncio.sleep(1)  # the held cancellation lands here
        after.append("not reached")

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()
    fut.set_result("answer")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == ["answer"] and task.cancelling() == 2


async def test_outcome_of_raises_the_futures_error_or_cancellation() -> None:
    loop = asyncio.get_running_loop()
    failed: HeldFuture[str] = HeldFuture(loop=loop)
    failed.set_exception(ConnectionError("gone"))
    with pytest.raises(ConnectionError):
        await outcome_of(failed)
    cancelled: HeldFuture[str] = HeldFuture(loop=loop)
    task = asyncio.create_task(outcome_of(cancelled))
    await asyncio.sleep(0)
    assert not cancelled.cancel()  # what the task's cancellation asks: declined
    cancelled.drop()  # the call itself was dropped (Scripts.cancel_pending): at once
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_held_call_whose_flush_is_cancelled_ends_instead_of_waiting_for_ever(
    scripts: Scripts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller holding its cancellation for a coalesced call's answer (a commit in place) is
    released when the owner cancels the call's flush before it answered (cancel_pending at close)."""
    sent, never = asyncio.Event(), asyncio.Event()

    async def no_answer(name: str, keys: list[str], args: list[Any], before: list[Any] | None = None) -> Any:
        sent.set()
        await never.wait()  # the reply never comes

    monkeypatch.setattr(scripts, "_direct", no_answer)
    caller = asyncio.create_task(scripts._call("commit", [], [], hold_cancel=True))
    await asyncio.wait_for(sent.wait(), 5)
    caller.cancel()
    await asyncio.sleep(0.01)
    assert not caller.done()  # held: the call was sent, its answer is waited for
    await scripts.cancel_pending()
    await asyncio.wait({caller}, timeout=5)
    assert caller.done(), "the caller waits for an answer that never comes"
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_settled_in_place_applies_the_outcome_then_delivers_the_cancellation() -> None:
    loop = asyncio.get_running_loop()
    applied: list[str] = []
    fut: HeldFuture[str] = HeldFuture(loop=loop)

    async def attempt() -> str:
        answer = await outcome_of(fut)
        applied.append(answer)
        if answer == "refused":
            raise RuntimeError("dropped: the cancellation wins")
        return answer

    task = asyncio.create_task(settled_in_place(attempt, "commit"))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    fut.set_result("refused")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert applied == ["refused"]
    fut = HeldFuture(loop=loop)
    fut.set_result("answer")
    assert await settled_in_place(attempt, "commit") == "answer"  # no cancellation: the outcome
