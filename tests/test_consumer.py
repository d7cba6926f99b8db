"""Decoupled producer and trainer processes around a shared results stream (a consumer group)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from broker import FleetClient
from broker.client.consumer import Delivery, ResultConsumer
from broker.client.fleet import MAX_BLOCK_MS
from broker.redis.embedded import RedisServer
from tests.procs import Fleet
from tests.support import WorkerPool
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


def role(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "tests.consumer_roles", *args], env=dict(os.environ))


async def test_results_reach_a_consumer_group_and_are_handled_once(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-lm", mode="tokens")
    acks = [await s.enqueue(i, results_stream="rollouts", token_ids=[i]) for i in range(5)]
    assert [a.status for a in acks] == ["queued"] * 5
    bad = await s.enqueue(9, results_stream="rollouts", token_ids=[1])
    assert bad.status == "error" and bad.error and bad.error.code.value == "step_out_of_order"
    seen: list[int] = []
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        while len(seen) < 5:
            for d in await results.read(block_ms=200):
                seen.append(d.result.step_id)
                assert await d.ack() is True
        # a committed step enqueued again answers "committed" and is not delivered twice
        again = await s.enqueue(4, results_stream="rollouts", token_ids=[4])
        assert again.status == "committed"
        assert await results.read(block_ms=100) == []
    assert seen == [0, 1, 2, 3, 4]


async def test_ack_many_acknowledges_a_whole_read_and_knows_handled_steps(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-lm", mode="tokens")
    for i in range(6):
        assert (await s.enqueue(i, results_stream="rollouts", token_ids=[i])).status == "queued"
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        taken: list[Delivery] = []
        for _ in range(50):  # bounded: 50 reads of at most 200 ms
            taken += await results.read(block_ms=200)
            if len(taken) == 6:
                break
        assert [d.result.step_id for d in taken] == list(range(6))
        assert await results.ack_many(taken) == [True] * 6
        assert await results.ack_many(taken[:2]) == [False] * 2  # handled already: a duplicate
        assert await results.ack_many([]) == []
        assert (await fleet.redis.xpending(fleet.keys.reply("rollouts"), "g"))["pending"] == 0
        assert await fleet.redis.xlen(fleet.keys.reply("rollouts")) == 0


@pytest.mark.slow
async def test_a_consumer_whose_stream_vanished_recreates_its_group_and_reads_on(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-lm", mode="tokens")
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        await fleet.redis.delete(fleet.keys.reply("rollouts"))  # as a Redis restarted without persistence
        assert await results.read(block_ms=100) == []
        assert (await s.enqueue(0, results_stream="rollouts", token_ids=[1])).status == "queued"
        seen: list[int] = []
        for _ in range(50):
            seen += [d.result.step_id for d in await results.read(block_ms=100)]
            if seen:
                break
        assert seen == [0]


async def test_producer_and_two_trainers_one_killed_mid_run(redis_server: RedisServer, prefix: str) -> None:
    procs = Fleet(redis_server.url, prefix)
    trainers: list[subprocess.Popen[bytes]] = []
    redis = Redis.from_url(redis_server.url)
    try:
        procs.worker()
        await procs.wait_active(1)
        sessions, steps = 6, 40
        trainers = [role("trainer", redis_server.url, prefix, "t1"), role("trainer", redis_server.url, prefix, "t2")]
        producer = role("producer", redis_server.url, prefix, str(sessions), str(steps))
        await asyncio.sleep(0.6)
        trainers[0].kill()  # mid-run: what it read and did not acknowledge is claimed by t2
        assert await asyncio.to_thread(producer.wait, 60) == 0
        total = sessions * steps
        for _ in range(300):
            if await redis.hlen(f"{prefix}:store") == total:
                break
            await asyncio.sleep(0.05)
        stored = {k.decode(): v.decode() for k, v in (await redis.hgetall(f"{prefix}:store")).items()}
        assert len(stored) == total  # every result reached a trainer: none lost
        assert "t2" in stored.values()
        deliveries: dict[str, list[str]] = {}
        for entry in await redis.lrange(f"{prefix}:deliveries", 0, -1):
            key, name = entry.decode().rsplit(":", 1)
            deliveries.setdefault(key, []).append(name)
        # At least once, and twice only for what the killed trainer got and never acknowledged.
        assert set(deliveries) == set(stored)
        assert all(names == [names[0]] or names == ["t1", "t2"] for names in deliveries.values()), deliveries
        stream = f"{prefix}:{{0}}:reply:rollouts"
        for _ in range(100):  # every entry acknowledged and deleted
            pending = await redis.xpending(stream, "trainers")
            if pending["pending"] == 0 and await redis.xlen(stream) == 0:
                break
            await asyncio.sleep(0.05)
        assert pending["pending"] == 0 and await redis.xlen(stream) == 0
    finally:
        for t in trainers:
            t.kill()
            t.wait(10)
        procs.close()
        await redis.aclose()


async def test_a_read_block_is_bounded(fleet: FleetClient) -> None:
    async with ResultConsumer(fleet, "r", group="g", consumer="c") as results:
        for bad in (0, -1, MAX_BLOCK_MS + 1, 1.5, True):  # 0 would block for ever
            with pytest.raises(ValueError, match="block_ms"):
                await results.read(block_ms=bad)  # type: ignore[arg-type]
        assert await results.read(block_ms=1) == []


async def test_enqueue_refuses_a_keyword_it_does_not_know_and_honours_min_policy_version(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    """A typo is a TypeError at the caller (it was silently dropped), and min_policy_version, which
    submit takes, is honoured by enqueue too: a step needing a version no worker has is held back."""
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-lm", mode="tokens")
    with pytest.raises(TypeError):
        await s.enqueue(0, results_stream="rollouts", token_id=[1])  # type: ignore[call-arg]
    ack = await s.enqueue(0, results_stream="rollouts", token_ids=[1], min_policy_version=5)
    assert ack.status == "queued"
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        deliveries = await results.read(block_ms=500)
    assert deliveries == [] or all(not d.result.ok for d in deliveries)


async def test_a_read_while_redis_is_down_is_empty_and_reads_go_on_once_it_is_back() -> None:
    """No exception out of read(): an outage is an empty read after at most block_ms (and a backoff
    between failed reads); once Redis is back (empty: no persistence here) the group is made again."""
    server = RedisServer().start()
    port = server.port
    try:
        async with FleetClient(server.url, prefix="t") as fleet, \
                ResultConsumer(fleet, "rollouts", consumer="c1") as results:
            assert await results.read(block_ms=100) == []
            server.stop(kill=True)
            for _ in range(3):
                started = time.monotonic()
                assert await results.read(block_ms=300) == []  # a failed read, not an exception
                assert time.monotonic() - started < 5.0
            server.cleanup()
            server = RedisServer(port=port).start()
            deadline = time.monotonic() + 10.0
            while not await _group_exists(fleet, results):
                assert time.monotonic() < deadline, "the consumer never read again"
                assert await results.read(block_ms=100) == []
    finally:
        server.cleanup()


async def _group_exists(fleet: FleetClient, results: ResultConsumer) -> bool:
    try:
        groups = await fleet.redis.xinfo_groups(fleet.keys.reply("rollouts"))
    except ResponseError:  # the stream is not there yet
        return False
    return any(g["name"] in ("trainers", b"trainers") for g in groups)
