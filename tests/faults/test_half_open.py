"""The deadlines of broker/redis/connect.py against a real half-open partition (iptables DROP: the
peer neither answers nor resets): a blocked read and a command on a connection gone half-open
fail with a Redis error instead of waiting on TCP's retransmissions (about 15 minutes), a connect
to a host that drops everything gives up, a task cancelled while connecting finishes, and the same
client works again once the partition heals. The bounds below only stop a hung test; they are
minutes above what the deadlines give (seconds)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable
from typing import Any

import pytest

from bench.partition import Lab
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.connect import open_redis

pytestmark = [pytest.mark.asyncio, pytest.mark.faults, pytest.mark.timeout(300)]
BOUND_S = 60.0  # far below TCP's own give-up time, far above the deadlines
CANCELS = 20


async def ends_with(call: Awaitable[Any]) -> BaseException | None:
    """What ``call`` raised (None: it returned); fails the test if it is still running at the bound."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=BOUND_S)
    if not done:
        task.cancel()
        pytest.fail(f"still waiting after {BOUND_S}s on a half-open connection")
    return task.exception()


async def answers(lab: Lab) -> Any:
    redis = open_redis(lab.url)
    for _ in range(300):
        try:
            await redis.ping()
            return redis
        except REDIS_ERRORS:
            await asyncio.sleep(0.1)
    pytest.fail("redis never answered")


async def test_a_blocked_read_and_a_command_on_a_half_open_connection_fail_and_the_client_heals(
        partition_lab: Lab) -> None:
    redis = await answers(partition_lab)
    stream = f"t{uuid.uuid4().hex[:8]}"
    try:
        reader = asyncio.ensure_future(redis.xread({stream: "$"}, block=1000))  # blocked on its connection
        pinger = redis.ping()  # a second connection from the pool, sent into the partition
        await asyncio.sleep(0.05)
        partition_lab.net.cut(partition_lab.net.root_ip, partition_lab.redis)
        for call in (reader, pinger):
            error = await ends_with(call)
            assert isinstance(error, REDIS_ERRORS), error
        partition_lab.net.heal(partition_lab.net.root_ip, partition_lab.redis)
        for _ in range(100):  # the same client: a fresh connection on its next command
            try:
                assert await redis.xread({stream: "$"}, block=10) == []
                break
            except REDIS_ERRORS:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the client did not reconnect after the heal")
    finally:
        partition_lab.net.heal(partition_lab.net.root_ip, partition_lab.redis)
        await redis.aclose()


async def test_a_connect_into_a_partition_gives_up_and_a_cancelled_connect_finishes(partition_lab: Lab) -> None:
    await (await answers(partition_lab)).aclose()
    partition_lab.net.cut(partition_lab.net.root_ip, partition_lab.redis)
    rng = random.Random(5)
    try:
        fresh = open_redis(partition_lab.url)
        error = await ends_with(fresh.ping())
        assert isinstance(error, REDIS_ERRORS), error
        await fresh.aclose()
        for _ in range(CANCELS):
            client = open_redis(partition_lab.url)
            task = asyncio.ensure_future(client.xreadgroup("g", "c", {"s": ">"}, block=1000))
            await asyncio.sleep(rng.uniform(0.0, 1.5))  # inside the connect, or between two attempts
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=BOUND_S)
            assert done, "a task cancelled while connecting into a partition did not finish"
            await client.aclose()
    finally:
        partition_lab.net.heal(partition_lab.net.root_ip, partition_lab.redis)
