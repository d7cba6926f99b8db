"""The trainer's reply reader deletes what it has read with one ``XTRIM MINID`` per interval, not an
``XDEL`` per read: entries read since the last trim leave together, entries not read yet stay, and
a trim that fails is sent again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from broker.client.replies import ReplyReader
from broker.redis.embedded import free_port
from broker.redis.layouts import ReplyEntry
from broker.redis.scripts import Scripts

pytestmark = pytest.mark.asyncio
WAIT_S = 10.0


async def calls(redis: Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def until(done: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await done():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def reply(redis: Redis, reader: ReplyReader, stream: str, job: str) -> bytes:
    fut = reader.expect(job)
    await redis.xadd(stream, ReplyEntry("step", job, 0, job.encode()).to_fields())
    return (await asyncio.wait_for(fut, WAIT_S)).result


async def test_reads_within_one_interval_leave_in_one_trim_and_the_rest_on_stop(scripts: Scripts) -> None:
    redis, stream = scripts.redis, scripts.keys.reply("trim")
    await redis.config_resetstat()
    # No idle block ends while the test runs, and one trim interval covers it: only the first read
    # (nothing trimmed before it) and the stop trim.
    reader = ReplyReader(redis, stream, block_ms=60_000, trim_interval_s=3600.0)
    reader.start()
    try:
        assert await reply(redis, reader, stream, "j0") == b"j0"

        async def first_trimmed() -> bool:
            return await redis.xlen(stream) == 0

        await until(first_trimmed, "the first read's entry was not trimmed")
        for i in (1, 2, 3):
            assert await reply(redis, reader, stream, f"j{i}") == f"j{i}".encode()
        assert await redis.xlen(stream) == 3  # read, inside the interval: kept until the next trim
        assert await calls(redis, "xtrim") == 1 and await calls(redis, "xdel") == 0
    finally:
        await reader.stop()
    assert await redis.xlen(stream) == 0 and await calls(redis, "xtrim") == 2


async def test_an_idle_block_trims_what_was_read(scripts: Scripts) -> None:
    redis, stream = scripts.redis, scripts.keys.reply("idle")
    reader = ReplyReader(redis, stream, block_ms=100, trim_interval_s=3600.0)
    reader.start()
    try:
        assert await reply(redis, reader, stream, "a") == b"a"
        assert await reply(redis, reader, stream, "b") == b"b"

        async def empty() -> bool:
            return await redis.xlen(stream) == 0

        await until(empty, "entries read stayed after a read that found nothing new")
    finally:
        await reader.stop()


async def test_a_trim_deletes_through_the_last_entry_read_and_none_after_it(scripts: Scripts) -> None:
    redis, stream = scripts.redis, scripts.keys.reply("bound")
    for entry_id in ("5-0", "5-1", "5-2", "6-0"):
        await redis.xadd(stream, {"kind": "step"}, id=entry_id)
    reader = ReplyReader(redis, stream)
    await reader._delete_through(b"5-1")
    assert [entry_id for entry_id, _ in await redis.xrange(stream)] == [b"5-2", b"6-0"]


async def test_a_trim_that_fails_is_sent_again(scripts: Scripts) -> None:
    dead = Redis(port=free_port(), socket_connect_timeout=1.0)
    try:
        reader = ReplyReader(dead, "nowhere")
        await reader._delete_through(b"7-0")  # refused: the entries read are still to trim
        assert reader._untrimmed
    finally:
        await dead.aclose()
