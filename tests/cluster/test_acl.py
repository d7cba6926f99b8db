"""The fleet's documented ACL on a Redis Cluster: set on every node (a cluster does not share ACL
users), it lets a worker, a client, status and sessions run, and Redis denies them nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from broker import FleetClient
from broker.ops.acl import fleet_acl_rules
from broker.ops.sessions import list_sessions
from broker.ops.status import cell_status
from broker.redis.embedded_cluster import RedisCluster
from tests.support import worker_pool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.cluster


@pytest.fixture
async def acl_cluster_url(redis_cluster: RedisCluster, prefix: str) -> AsyncIterator[str]:
    user = f"fleet-{prefix}"
    for node in redis_cluster.running():
        async with Redis(port=node.port) as admin:
            await admin.execute_command("ACL", "SETUSER", user, "on", ">pw-acl", *fleet_acl_rules(prefix))
            await admin.execute_command("ACL", "LOG", "RESET")
    yield f"redis+cluster://{user}:pw-acl@" + redis_cluster.url.split("://", 1)[1]
    for node in redis_cluster.running():
        async with Redis(port=node.port) as admin:
            await admin.acl_deluser(user)


async def test_every_component_runs_under_the_fleet_acl(acl_cluster_url: str, prefix: str,
                                                        redis_cluster: RedisCluster) -> None:
    async with worker_pool(acl_cluster_url, prefix) as workers, FleetClient(acl_cluster_url, prefix=prefix) as fleet:
        await workers.add(NullEngine())
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        for i in range(3):
            assert (await s.step(i, **world_step(i))).committed_step_id == i
        report = await cell_status(acl_cluster_url, prefix=prefix)
        assert len(report.workers) == 1 and report.live_sessions == 1
        assert [row.session_id for row in await list_sessions(fleet.redis, fleet.keys)] == [s.session_id]
    denied = []
    for node in redis_cluster.running():
        async with Redis(port=node.port) as admin:
            log = await admin.acl_log()
            denied += [(e["reason"], e["object"]) for e in log if e.get("username") == f"fleet-{prefix}"]
    assert denied == []
