"""The cluster tier: one local Redis Cluster (3 masters with a replica each) for the whole run.

Every component is pointed at it two ways: at ONE node that does not serve the cell's slot (a
replica of another master: every command starts with a MOVED the client must follow) and at the
comma-separated list of every node. Tests here carry the ``cluster`` mark and are collected only
when ``-m`` names it (tests/conftest.py), so the fast and slow tiers never start a cluster."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.crc import key_slot

from broker import FleetClient
from broker.redis.embedded import RedisServer
from broker.redis.embedded_cluster import RedisCluster, running_cluster
from broker.redis.keys import CellKeys
from tests.support import WorkerPool, worker_pool

CELL = CellKeys().cell  # the tests' cell: the default one, as the in-process workers use


def cell_slot(cell: str = CELL) -> int:
    return int(key_slot(cell.encode()))


def node_away_from_slot(cluster: RedisCluster, slot: int) -> RedisServer:
    """A replica of a master that does not serve ``slot``: nothing of the cell is on it."""
    owner = cluster.master_of_slot(slot)
    for node in cluster.running():
        if node is not owner and cluster.role(node) == "slave" and not _replicates(cluster, node, owner):
            return node
    raise LookupError("no replica away from the cell's master")


def _replicates(cluster: RedisCluster, node: RedisServer, master: RedisServer) -> bool:
    return f"master_port:{master.port}" in cluster._cli(node, "INFO", "replication").replace("\r", "")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture(params=["one-node", "node-list"])
def cluster_url(request: pytest.FixtureRequest, redis_cluster: RedisCluster) -> str:
    """The cluster's URL as a user would write it: one node away from the cell, or every node."""
    if request.param == "node-list":
        return redis_cluster.url
    node = node_away_from_slot(redis_cluster, cell_slot())
    return f"redis+cluster://127.0.0.1:{node.port}"


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def fleet(cluster_url: str, prefix: str) -> AsyncIterator[FleetClient]:
    async with FleetClient(cluster_url, prefix=prefix) as client:
        yield client


@pytest.fixture
async def workers(cluster_url: str, prefix: str) -> AsyncIterator[WorkerPool]:
    async with worker_pool(cluster_url, prefix) as pool:
        yield pool
