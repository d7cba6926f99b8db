"""A master failover under a stepping fleet: the cell's master is killed, its replica takes over
(about 2 node timeouts later), and the worker, the client and the in-flight steps ride it out as
"Redis unavailable, retry": nothing crashes, no step commits twice, the steps go on.

Its own cluster: the test leaves it with a master that has no replica."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from broker import FleetClient
from broker.redis.embedded_cluster import RedisCluster, find_redis_cli, running_cluster
from tests.cluster.conftest import cell_slot
from tests.support import worker_pool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.cluster
LEASE = {"heartbeat_ms": 500, "lease_ms": 20_000}  # a lease longer than the failover: no reaping


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[RedisCluster]:
    with running_cluster() as cluster:
        yield cluster


async def test_steps_ride_out_the_failover_of_the_cells_master(own_cluster: RedisCluster) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = own_cluster.url
    async with worker_pool(url, prefix) as workers, \
            FleetClient(url, prefix=prefix, lease_ms=LEASE["lease_ms"]) as fleet:
        running = await workers.add(NullEngine(), **LEASE)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        for i in range(3):
            assert (await s.step(i, **world_step(i))).committed_step_id == i
        master = own_cluster.master_of_slot(cell_slot())
        # Replication is asynchronous: the kill must not be what loses a commit here (that risk
        # and its cure are --durability's), so the replica has everything first.
        synced = subprocess.run([find_redis_cli(), "-p", str(master.port), "WAIT", "1", "5000"],
                                capture_output=True, text=True, timeout=10, check=True)
        assert synced.stdout.strip() == "1", synced.stdout
        master.stop(kill=True)
        in_flight = [asyncio.create_task(s.step(i, **world_step(i))) for i in range(3, 6)]
        results = await asyncio.wait_for(asyncio.gather(*in_flight), 120)
        assert [r.committed_step_id for r in results] == [3, 4, 5], [r.error for r in results]
        own_cluster.wait_ok(60)
        assert own_cluster.master_of_slot(cell_slot()) is not master
        assert (await s.step(6, **world_step(6))).committed_step_id == 6
        assert (await s.status()).committed_step_id == 6
        assert not running.task.done()  # the worker's loops rode it out
