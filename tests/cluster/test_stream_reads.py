"""A cluster client sends an XREADGROUP once (broker/redis/connect.py): a read whose connection
fails may have delivered entries, so the error reaches the caller, whose next read starts from its
pending entries, instead of redis-py sending the read again for new entries only."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from broker.redis.connect import open_redis
from broker.redis.embedded_cluster import RedisCluster

pytestmark = pytest.mark.cluster


async def test_a_group_read_whose_connection_is_killed_raises_instead_of_reading_again(
        redis_cluster: RedisCluster, prefix: str) -> None:
    key = f"{prefix}:{{c}}:inbox"
    client = open_redis(redis_cluster.url)
    master = redis_cluster.master_of_slot(int(key_slot(key.encode())))
    admin = Redis(port=master.port, decode_responses=True)
    try:
        await client.xgroup_create(key, "g", id="0", mkstream=True)
        read = asyncio.ensure_future(client.xreadgroup("g", "me", {key: ">"}, block=20_000))
        deadline = time.monotonic() + 5.0
        blocked: list[str] = []
        while not blocked:
            assert time.monotonic() < deadline, "the read never blocked on the key's master"
            await asyncio.sleep(0.05)
            blocked = [c["id"] for c in await admin.client_list() if c.get("cmd") == "xreadgroup"]
        await admin.execute_command("CLIENT", "KILL", "ID", blocked[0])
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(read, 5.0)  # sent again, it would block for its 20 s
    finally:
        await client.delete(key)
        await client.aclose()
        await admin.aclose()
