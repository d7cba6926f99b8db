"""A local cluster started with more redis-server arguments (bench.fleet_sim --io-threads) gives
them to every node."""

from __future__ import annotations

import pytest
import redis

from broker.redis.embedded_cluster import running_cluster

pytestmark = pytest.mark.cluster


def test_every_node_runs_with_the_server_args() -> None:
    with running_cluster(3, 0, ["--io-threads", "2", "--io-threads-do-reads", "yes"]) as cluster:
        assert len(cluster.nodes) == 3
        for node in cluster.nodes:
            client = redis.Redis(port=node.port)
            try:
                assert client.config_get("io-threads") == {"io-threads": "2"}
                assert client.config_get("io-threads-do-reads") == {"io-threads-do-reads": "yes"}
            finally:
                client.close()
