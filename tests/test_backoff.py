"""The one backoff of every Redis retry loop: 50 ms, doubled, capped at 2 s; and the retry helper."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.redis.backoff import Backoff, cancel_and_wait, until_redis_answers, wait_set


async def test_delays_double_from_50ms_up_to_the_cap_and_reset_after_a_success() -> None:
    backoff = Backoff(start=0.001, cap=0.004)
    seen = []
    for _ in range(4):
        seen.append(backoff.delay)
        await backoff.wait()
    assert seen == [0.001, 0.002, 0.004, 0.004]
    backoff.reset()
    assert backoff.delay == 0.001
    assert (Backoff().start, Backoff().cap) == (0.05, 2.0)


async def test_jitter_spreads_each_wait_around_the_delay() -> None:
    backoff = Backoff(start=0.02, jitter=1.0)
    started = time.monotonic()
    await backoff.wait()
    assert 0.009 <= time.monotonic() - started < 0.2 and backoff.delay == 0.04


async def test_until_redis_answers_retries_connection_errors_only_until_an_answer() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise RedisConnectionError("down")
        return "answered"

    assert await until_redis_answers(flaky, "test call") == "answered" and calls == 3


async def test_a_cancellation_turned_into_a_connection_error_still_ends_the_retry_loop() -> None:
    """A client library that answers our cancel() with a ConnectionError must not keep a retry loop
    (and so the shutdown awaiting it) alive: the pending cancellation is raised again."""
    calls = 0

    async def call_that_hides_its_cancellation() -> None:
        nonlocal calls
        calls += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed by cancel") from None

    task = asyncio.create_task(until_redis_answers(call_that_hides_its_cancellation, "test call"))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert calls == 1


async def slow_to_stop(stopped: asyncio.Event, after_s: float = 0.3) -> None:
    """A task that takes ``after_s`` to end once cancelled (a read closing its connection)."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(after_s)
        stopped.set()
        raise


async def test_cancel_and_wait_ends_the_tasks_cancellation_not_the_callers() -> None:
    stopped = asyncio.Event()
    child = asyncio.create_task(slow_to_stop(stopped, after_s=0.01))
    await asyncio.sleep(0)
    await cancel_and_wait(child)  # the child's CancelledError ends here
    assert child.cancelled() and stopped.is_set()

    stopped = asyncio.Event()
    child = asyncio.create_task(slow_to_stop(stopped))
    await asyncio.sleep(0)

    async def caller() -> str:
        await cancel_and_wait(child)
        return "went on as if not cancelled"

    outer = asyncio.create_task(caller())
    await asyncio.sleep(0.05)  # the caller waits for the child to end
    outer.cancel()
    done, _ = await asyncio.wait({outer}, timeout=5)
    assert outer in done and outer.cancelled()  # suppress(CancelledError) here would have returned


async def test_cancel_and_wait_in_the_cleanup_of_a_cancelled_caller_waits_for_the_tasks() -> None:
    stopped = asyncio.Event()
    child = asyncio.create_task(slow_to_stop(stopped, after_s=0.05))

    async def caller() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await cancel_and_wait(child)

    outer = asyncio.create_task(caller())
    await asyncio.sleep(0.01)
    outer.cancel()
    done, _ = await asyncio.wait({outer}, timeout=5)
    assert outer in done and outer.cancelled() and child.cancelled() and stopped.is_set()


async def test_cancel_and_wait_raises_a_tasks_own_error_after_waiting_for_all() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("close failed") from None

    stopped = asyncio.Event()
    failing, slow = asyncio.create_task(fails_on_cancel()), asyncio.create_task(slow_to_stop(stopped, 0.05))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="close failed"):
        await cancel_and_wait(failing, slow)
    assert slow.cancelled() and stopped.is_set()


async def test_wait_set_passes_on_a_cancel_that_arrives_as_the_event_is_set() -> None:
    """The turn that sets the event also cancels the waiter: the waiter must end cancelled.
    ``asyncio.wait_for(event.wait(), ...)`` returns True there on Python 3.11, and a loop around it
    goes on for ever (what made a worker's shutdown hang)."""
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_set(event, 5.0))
    await asyncio.sleep(0)  # the waiter is now blocked on the event
    event.set()
    waiter.cancel()
    done, _ = await asyncio.wait({waiter}, timeout=5.0)
    assert done and waiter.cancelled()


async def test_wait_set_says_whether_the_event_was_set_in_time() -> None:
    event = asyncio.Event()
    started = time.monotonic()
    assert await wait_set(event, 0.05) is False
    assert time.monotonic() - started >= 0.04
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5.0) is True
    assert await wait_set(event, 0.0) is True  # already set: no time needed
