"""The control plane on a Redis Cluster: the supervisor's passes without arq (one claim per cell
and period), what of arq fails there, the scripts after a master lost its script cache, and the
Redis clock read from the cell's own master."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import pytest
from arq.connections import ArqRedis
from redis.exceptions import ResponseError

from broker import FleetClient
from broker.ops.failover import sessions_of
from broker.ops.pass_loop import claim
from broker.ops.supervisor import ArqOnClusterError, SupervisorSettings, request_replay
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis, server_time
from broker.redis.embedded_cluster import RedisCluster
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts
from tests.cluster.conftest import cell_slot
from tests.procs import Fleet
from tests.support import FAST, WorkerPool, world_step
from workers.engines.null import NullEngine

pytestmark = pytest.mark.cluster


async def test_the_supervisor_reaps_a_dead_worker_without_arq(cluster_url: str, prefix: str, fleet: FleetClient,
                                                               workers: WorkerPool) -> None:
    # Workers that do not reap: only the supervisor can move the dead one's session.
    doomed = await workers.add(NullEngine(), reap=False, **FAST)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    await workers.add(NullEngine(), reap=False, **FAST)
    await workers.kill(doomed)
    procs = Fleet(cluster_url, prefix, lease_ms=FAST["lease_ms"])
    try:
        supervisor = procs.supervisor()  # rollout-fleet supervisor --redis-url redis+cluster://...
        for _ in range(600):  # bounded: 60 s for the process to start and reap
            if not await sessions_of(fleet.scripts, doomed.id):
                break
            await asyncio.sleep(0.1)
        assert not await sessions_of(fleet.scripts, doomed.id)
        step = await s.step(1, **world_step(1))
        assert step.ok and step.committed_step_id == 1
        # the trim pass ran too: its claim for this period is in the cell's slot
        assert await fleet.redis.exists(CellKeys(prefix).pass_claim("trim"))
        supervisor.send_signal(signal.SIGTERM)  # stops its loop and closes its connections
        assert await asyncio.to_thread(supervisor.wait, 60) == 0
    finally:
        procs.close()


async def test_one_supervisor_claims_each_period(cluster_url: str, prefix: str) -> None:
    redis = open_redis(cluster_url)
    try:
        keys = CellKeys(prefix)  # two supervisors of one cell claim the same keys
        assert await claim(redis, keys.pass_claim("reap"), 60_000) is True
        assert await claim(redis, keys.pass_claim("reap"), 60_000) is False
        assert await claim(redis, keys.pass_claim("trim"), 60_000) is True  # each pass has its own claim
        assert 0 < await redis.pttl(CellKeys(prefix).pass_claim("reap")) <= 60_000
    finally:
        await redis.aclose()


async def test_arq_cannot_queue_a_job_on_a_cluster(redis_cluster: RedisCluster, prefix: str) -> None:
    """The finding docs/cluster.md records: even on the very master of the queue's slot, arq's
    job key (arq:job:<id>, no hash tag) lives in another slot, so enqueueing is redirected away."""
    keys = CellKeys(prefix)
    master = redis_cluster.master_of_slot(cell_slot())
    pool = ArqRedis(host="127.0.0.1", port=master.port)
    try:
        with pytest.raises(ResponseError, match=r"MOVED|CROSSSLOT"):
            await pool.enqueue_job("replay_dead", {}, _queue_name=keys.arq_queue, _job_id="j1")
    finally:
        await pool.aclose()
    settings = SupervisorSettings(cell_config=CellConfig(redis_url=redis_cluster.url, prefix=prefix))
    with pytest.raises(ArqOnClusterError, match="rollout-fleet replay run"):
        await request_replay(settings, {})


async def test_scripts_load_again_on_a_master_that_lost_them(cluster_url: str, prefix: str,
                                                             redis_cluster: RedisCluster) -> None:
    """A replica promoted to master has no script cache: EVALSHA answers NOSCRIPT, alone or in a
    coalesced pipeline, and the script is loaded on the masters and run."""
    redis: Any = open_redis(cluster_url)
    try:
        scripts = Scripts(redis, CellKeys(prefix))
        await scripts.register("w1", capacity=1, pools=[], ttl_ms=60_000, fields={"state": "active"})
        for coalesced in (False, True):
            await redis.execute_command("SCRIPT", "FLUSH", target_nodes="primaries")
            beats = await asyncio.gather(*[scripts.heartbeat("w1", ttl_ms=60_000, fields={})
                                           for _ in range(3 if coalesced else 1)])
            assert all(beat.registered for beat in beats)
    finally:
        await redis.aclose()


async def test_time_comes_from_the_cells_master(cluster_url: str, redis_cluster: RedisCluster) -> None:
    redis: Any = open_redis(cluster_url)
    try:
        await redis.execute_command("CONFIG", "RESETSTAT", target_nodes="primaries")
        await server_time(redis, CellKeys().workers)
        owner = redis_cluster.master_of_slot(cell_slot())
        calls = {node.port: _time_calls(redis_cluster._cli(node, "INFO", "commandstats"))
                 for node in redis_cluster.running() if redis_cluster.role(node) == "master"}
        assert calls == {port: (1 if port == owner.port else 0) for port in calls}
    finally:
        await redis.aclose()


def _time_calls(commandstats: str) -> int:
    for line in commandstats.splitlines():
        if line.startswith("cmdstat_time:"):
            return int(line.split("calls=", 1)[1].split(",", 1)[0])
    return 0


async def test_stream_reads_are_routed_without_asking_a_server_for_their_keys(
        cluster_url: str, redis_cluster: RedisCluster) -> None:
    """redis-py's cluster client asks one fixed node ``COMMAND GETKEYS`` before every XREAD and
    XREADGROUP (their keys follow STREAMS); at fleet scale that node pays for every blocked read
    of every worker (docs/sizing.md). The fleet's client reads the keys itself."""
    redis: Any = open_redis(cluster_url)
    keys = CellKeys()
    try:
        await redis.xadd(keys.control, {"k": "v"})
        with contextlib.suppress(ResponseError):
            await redis.xgroup_create(keys.inbox("getkeys-test"), "g", id="0", mkstream=True)
        await redis.execute_command("CONFIG", "RESETSTAT", target_nodes="all")
        for _ in range(5):
            assert await redis.xread({keys.control: "0"}, count=1)
            await redis.xreadgroup("g", "c", {keys.inbox("getkeys-test"): ">"}, count=1, block=10)
        stats = {node.port: redis_cluster._cli(node, "INFO", "commandstats") for node in redis_cluster.running()}
        assert not any("cmdstat_command|getkeys:" in text for text in stats.values()), stats
        owner = redis_cluster.master_of_slot(cell_slot())
        assert "cmdstat_xread:calls=5" in stats[owner.port].replace("\r", "")
    finally:
        await redis.aclose()
