"""broker/redis/connect.py's deadlines: every connection it builds (clients, arq's pool, cluster
nodes) has a connect timeout and kernel-side dead-peer detection (keepalive + TCP_USER_TIMEOUT), and
no socket timeout on reads; a task cancelled while blocked in XREADGROUP on such a connection always
finishes (the redis-py 5.3.1 hang that kept timeouts out before needs a socket timeout on the read).
Half-open connections themselves need a partition: the fault tier (tests/faults/) makes them."""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from broker.redis.connect import (
    CONNECT_TIMEOUT_S,
    USER_TIMEOUT_MS,
    connection_deadlines,
    keepalive_options,
    open_pool,
    open_redis,
)
from broker.redis.embedded import RedisServer

CANCELS = 200  # the hang showed within a few of 200 cancels with a socket timeout set
CANCEL_BOUND_S = 10.0  # a cancelled read ends at once; this only bounds a hung one


def tcp_options(conn: AbstractConnection) -> dict[str, int]:
    sock = conn._writer.transport.get_extra_info("socket")  # type: ignore[union-attr]
    return {"keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            **{str(opt): sock.getsockopt(socket.IPPROTO_TCP, opt) for opt in keepalive_options()}}


async def connected(pool: ConnectionPool) -> AbstractConnection:
    conn = await pool.get_connection()
    await conn.send_command("PING")
    assert await conn.read_response() in (b"PONG", "PONG")
    return conn


def expected_tcp() -> dict[str, int]:
    return {"keepalive": 1, **{str(opt): value for opt, value in keepalive_options().items()}}


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_the_deadlines_name_keepalive_a_user_timeout_and_a_connect_timeout_but_no_read_timeout() -> None:
    tcp = connection_deadlines("redis://10.0.0.1:6379")
    assert tcp["socket_connect_timeout"] == CONNECT_TIMEOUT_S and tcp["socket_keepalive"] is True
    assert tcp["socket_keepalive_options"][socket.TCP_USER_TIMEOUT] == USER_TIMEOUT_MS
    assert "socket_timeout" not in tcp
    assert connection_deadlines("unix:///run/redis.sock") == {"socket_connect_timeout": CONNECT_TIMEOUT_S}


async def test_a_client_connection_has_the_deadlines_on_its_socket(redis_server: RedisServer) -> None:
    redis = open_redis(redis_server.url)
    pool = redis.connection_pool
    conn = await connected(pool)
    try:
        assert tcp_options(conn) == expected_tcp()
        assert conn.socket_timeout is None and conn.socket_connect_timeout == CONNECT_TIMEOUT_S
    finally:
        await pool.release(conn)
        await redis.aclose()


async def test_arqs_pool_has_the_same_deadlines(redis_server: RedisServer) -> None:
    pool = open_pool(redis_server.url)
    conn = await connected(pool)
    try:
        assert tcp_options(conn) == expected_tcp()
        assert conn.socket_timeout is None
    finally:
        await pool.release(conn)
        await pool.disconnect()


async def test_the_url_and_the_caller_still_override_a_deadline(redis_server: RedisServer) -> None:
    from_url = open_redis(f"{redis_server.url}?socket_connect_timeout=7")
    given = open_redis(redis_server.url, socket_timeout=5, socket_connect_timeout=5)  # the CLI's one-shot verbs
    try:
        assert from_url.connection_pool.connection_kwargs["socket_connect_timeout"] == 7
        assert given.connection_pool.connection_kwargs["socket_timeout"] == 5
        assert given.connection_pool.connection_kwargs["socket_keepalive"] is True
    finally:
        await from_url.aclose()
        await given.aclose()


def test_every_node_of_a_cluster_client_gets_the_deadlines_unless_its_url_says_otherwise() -> None:
    cluster = open_redis("redis+cluster://10.0.0.1:7000,10.0.0.2:7001")
    assert isinstance(cluster, RedisCluster)
    kwargs = cluster.nodes_manager.connection_kwargs
    assert kwargs["socket_keepalive"] is True and kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S
    assert kwargs["socket_keepalive_options"] == keepalive_options()
    tuned = open_redis("redis+cluster://10.0.0.1:7000?socket_connect_timeout=9")
    assert isinstance(tuned, RedisCluster)
    assert tuned.nodes_manager.connection_kwargs["socket_connect_timeout"] == 9


async def test_a_unix_socket_client_gets_the_connect_timeout_only(tmp_path: Any) -> None:
    redis = open_redis(f"unix://{tmp_path}/none.sock")
    try:
        kwargs = redis.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S and "socket_keepalive" not in kwargs
    finally:
        await redis.aclose()


async def blocked_reader(redis: Any, stream: str, block_ms: int) -> None:
    """A worker's inbox read in miniature: XREADGROUP again and again until cancelled."""
    while True:
        await redis.xreadgroup("g", "c", {stream: ">"}, count=16, block=block_ms)


async def test_a_task_cancelled_while_blocked_in_xreadgroup_always_finishes(redis_server: RedisServer) -> None:
    """CANCELS cancels, landing at random moments of reads that block 1 to 50 ms (so some land
    as the block ends and the reply arrives) or 1 s (mid-read); each task must end within the bound."""
    redis = open_redis(redis_server.url)
    stream = f"t{uuid.uuid4().hex[:10]}:inbox"
    await redis.xgroup_create(stream, "g", id="$", mkstream=True)
    rng = random.Random(13)
    hung: list[int] = []
    try:
        for i in range(CANCELS):
            task = asyncio.create_task(blocked_reader(redis, stream, rng.choice([1, 5, 20, 50, 1000])))
            await asyncio.sleep(rng.uniform(0.0, 0.06))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=CANCEL_BOUND_S)
            if not done:
                hung.append(i)
                break
            assert task.cancelled() or task.exception() is not None
        assert hung == [], f"a cancelled blocked read hung (try {hung})"
        assert await redis.ping()  # the client is still usable after every cancel
    finally:
        await redis.delete(stream)
        await redis.aclose()
