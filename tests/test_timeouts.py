"""No Redis call of a worker or a client waits for ever on a half-open connection: their clients
carry a socket timeout above their longest blocking read (connect.blocking_timeouts)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import FleetClient
from broker.client.consumer import ResultConsumer
from broker.client.fleet import MAX_BLOCK_MS
from broker.redis.connect import SOCKET_MARGIN_S, blocking_timeouts, open_redis
from tests.support import WorkerPool
from workers.engines.null import NullEngine


def _timeouts(redis: object) -> tuple[float, float]:
    kwargs = redis.connection_pool.connection_kwargs  # type: ignore[attr-defined]
    return kwargs["socket_timeout"], kwargs["socket_connect_timeout"]


async def test_a_worker_connection_times_out_above_its_block(workers: WorkerPool) -> None:
    running = await workers.add(NullEngine(), block_ms=250)
    socket_timeout, connect_timeout = _timeouts(running.worker._redis)
    assert socket_timeout == 0.25 + SOCKET_MARGIN_S
    assert 0 < connect_timeout < socket_timeout


async def test_a_client_connection_times_out_above_its_longest_block(fleet: FleetClient) -> None:
    socket_timeout, _ = _timeouts(fleet.redis)
    assert socket_timeout == MAX_BLOCK_MS / 1000 + SOCKET_MARGIN_S
    async with ResultConsumer(fleet, "r", group="g", consumer="c") as results:
        for bad in (0, -1, MAX_BLOCK_MS + 1, 1.5, True):
            with pytest.raises(ValueError, match="block_ms"):
                await results.read(block_ms=bad)  # type: ignore[arg-type]


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A TCP server that accepts and never answers: a half-open Redis, as after a network cut."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.slow
async def test_a_blocked_read_on_a_silent_connection_ends_with_a_timeout(silent_port: int) -> None:
    redis = open_redis(f"redis://127.0.0.1:{silent_port}/0", **blocking_timeouts(200))
    try:
        # The outer bound only keeps a regression from hanging the run; the client's own timeout
        # (0.2 s + the margin) is what must end the read.
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(redis.xread({"k": "$"}, block=200), 120)
    finally:
        await redis.aclose()
