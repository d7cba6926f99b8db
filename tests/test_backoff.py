"""The one backoff of every Redis retry loop: 50 ms, doubled, capped at 2 s; and the retry helper."""

from __future__ import annotations

import time

from redis.exceptions import ConnectionError as RedisConnectionError

from broker.redis.backoff import Backoff, until_redis_answers


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
