"""Cell names to Redis Cluster slots: our CRC16 against the published vector and against a real
cluster-enabled redis-server's CLUSTER KEYSLOT; picking cells on distinct masters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from broker.redis.embedded import RedisServer, running_redis
from broker.redis.embedded_cluster import cluster_port
from broker.redis.keys import CellKeys
from broker.redis.slots import SLOTS, cell_slot, cells_on_distinct_masters, crc16, master_of

NAMES = ["0", "1", "c0", "c1", "c17", "gpu-a", "east.2", "x" * 64, "ünï"]


def test_crc16_matches_the_published_xmodem_vector() -> None:
    assert crc16(b"123456789") == 0x31C3
    assert crc16(b"") == 0


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[RedisServer]:
    # the cluster bus listens on port + 10000: cluster_port() finds both free (Redis 6.2 has no --cluster-port)
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    with running_redis(port=cluster_port(), extra_args=args) as server:
        yield server


def test_cell_slots_equal_cluster_keyslot_of_every_key_of_the_cell(cluster_node: RedisServer) -> None:
    client = redis.Redis.from_url(cluster_node.url)
    try:
        for name in NAMES:
            keys = CellKeys("rf", name)
            for key in (keys.session("abc@" + name), keys.workers, keys.inbox("w1")):
                assert int(client.execute_command("CLUSTER", "KEYSLOT", key)) == cell_slot(name), key
    finally:
        client.close()


def test_cells_on_distinct_masters_land_on_each_master() -> None:
    thirds = [(0, 5460, "m1"), (5461, 10922, "m2"), (10923, SLOTS - 1, "m3")]
    names = cells_on_distinct_masters(thirds, 3)
    assert len(names) == 3
    assert {master_of(cell_slot(n), thirds) for n in names} == {"m1", "m2", "m3"}
    assert cells_on_distinct_masters(thirds, 3) == names  # deterministic: the lowest names that work
    two = cells_on_distinct_masters(thirds, 2, stem="gpu")
    assert all(n.startswith("gpu") for n in two) and len({master_of(cell_slot(n), thirds) for n in two}) == 2


def test_cells_on_distinct_masters_refuses_what_cannot_be_done() -> None:
    with pytest.raises(ValueError, match="need 3 masters; the cluster has 2"):
        cells_on_distinct_masters([(0, 8191, "a"), (8192, SLOTS - 1, "b")], 3)
    with pytest.raises(ValueError, match="at least 1"):
        cells_on_distinct_masters([(0, SLOTS - 1, "a")], 0)
    # a master that owns a single slot, which none of the first 50 names hashes to
    one_slot = [(0, SLOTS - 2, "a"), (SLOTS - 1, SLOTS - 1, "b")]
    assert SLOTS - 1 not in {cell_slot(f"c{i}") for i in range(50)}
    with pytest.raises(ValueError, match="among the first 50 tried"):
        cells_on_distinct_masters(one_slot, 2, max_tries=50)
