"""The Ray tier: one real local Ray cluster of several nodes on this machine for the whole run.

``ray.cluster_utils.Cluster`` starts a head node and worker nodes as separate raylets (CPU only:
nodes have one or two CPUs and a small object store, and no dashboard, for a 2-core machine).
The test process is the cluster's driver. Tests here carry the ``ray`` mark and are collected only
when ``-m`` names it (tests/conftest.py); they need Ray, which the Ray venv has
(scripts/run_ray_tests.sh)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer

OBJECT_STORE_BYTES = 80 * 2**20  # per node: the workers pass nothing through it
NODE = {"num_cpus": 2, "object_store_memory": OBJECT_STORE_BYTES}
LEASE_MS = 2000  # the tests' cell lease: a lost worker's sessions move within about this
HEARTBEAT = {"ROLLOUT_FLEET_HEARTBEAT_MS": "300"}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A head node (one CPU) and one worker node (two CPUs); tests add and remove more."""
    ray = pytest.importorskip("ray", reason="the Ray tier runs in the Ray venv (scripts/run_ray_tests.sh)")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def cell(redis_server: RedisServer) -> CellConfig:
    """A fresh cell (its own key prefix) on the session's private Redis."""
    return CellConfig(redis_url=redis_server.url, prefix=f"t{uuid.uuid4().hex[:10]}", lease_ms=LEASE_MS)


def fleet_actors(name: str) -> list[str]:
    """The names of every live Ray actor of fleet ``name`` (its controller and its workers)."""
    import ray

    from workers.ray_fleet import NAMESPACE

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and (a["name"] == name or a["name"].startswith(name + ":"))]


def fleet_groups(name: str) -> list[dict[str, Any]]:
    """The placement groups of fleet ``name`` that are not removed."""
    import ray

    return [t for t in ray.util.placement_group_table().values()
            if t.get("name", "").startswith(name + ":") and t.get("state") != "REMOVED"]
