"""Every trainer-side component on a Redis Cluster, pointed at one node away from the cell's slot
and at the list of every node: FleetClient (world and token sessions), SyncFleetClient, a results
consumer group and the HTTP gateway, with in-process workers on the same cluster URL."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from broker import FleetClient, SyncFleetClient
from broker.client.consumer import ResultConsumer
from broker.ops.dashboard_data import DashboardSource
from tests.support import WorkerPool, world_step
from tests.test_gateway import SESSIONS, GatewayServer, body
from workers.engines.null import NullEngine

pytestmark = pytest.mark.cluster


async def test_fleet_client_steps_world_and_token_sessions(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    world = await fleet.create_session(model="null-world", mode="world_model_env")
    tokens = await fleet.create_session(model="null-lm", mode="tokens")
    first = await world.step(0, **world_step(0))
    assert first.ok and first.committed_step_id == 0
    # pipelined: several steps of both sessions in flight at once, coalesced into script pipelines
    results = await asyncio.gather(*[world.submit(i, **world_step(i)) for i in range(1, 6)],
                                   *[tokens.submit(i, token_ids=[i, i + 1]) for i in range(5)])
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.committed_step_id for r in results] == [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    again = await world.step(5, **world_step(5))  # an idempotent retry answers the stored result
    assert again.ok and again.committed_step_id == 5 and again.output.keys() == results[4].output.keys()
    assert await world.reset() == -1
    assert (await tokens.status()).committed_step_id == 4
    await world.close()
    assert (await world.status()).closed


async def test_sync_client_steps_and_pipelines(cluster_url: str, prefix: str, workers: WorkerPool) -> None:
    await workers.add(NullEngine())

    def trainer() -> list[int]:
        with SyncFleetClient(cluster_url, prefix=prefix) as fleet:
            s = fleet.create_session(model="null-world", mode="world_model_env")
            assert s.step(0, **world_step(0)).committed_step_id == 0
            futures = [s.submit(i, **world_step(i)) for i in range(1, 6)]
            committed = [f.result(60).committed_step_id for f in futures]
            t = fleet.create_session(model="null-lm", mode="tokens")
            assert t.step(0, token_ids=[1, 2, 3]).ok
            s.close()
            return committed

    assert await asyncio.to_thread(trainer) == [1, 2, 3, 4, 5]


async def test_a_consumer_group_reads_and_acks_results(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-lm", mode="tokens")
    for i in range(4):
        assert (await s.enqueue(i, results_stream="rollouts", token_ids=[i])).status == "queued"
    seen: list[int] = []
    async with ResultConsumer(fleet, "rollouts", group="g", consumer="c1") as results:
        for _ in range(200):  # bounded: 200 reads of at most 200 ms
            for d in await results.read(block_ms=200):
                seen.append(d.result.step_id)
                assert await d.ack() is True
            if len(seen) == 4:
                break
        assert await results.read(block_ms=100) == []
    assert seen == [0, 1, 2, 3]


async def test_gateway_serves_sessions(cluster_url: str, prefix: str, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    async with GatewayServer(cluster_url, prefix, model_default="null-world") as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
        created = await http.post(SESSIONS, json={"model": "null-world"})
        assert created.status_code == 200, created.text
        sid = created.json()["session_id"]
        for i in range(3):
            r = await http.post(f"{SESSIONS}/{sid}/step", json=body(i))
            assert r.status_code == 200 and r.json()["model_metadata"]["committed_step_id"] == i, r.text
        status = await http.get(f"{SESSIONS}/{sid}/status")
        assert status.json()["committed_step_id"] == 2
        health = await http.get("/health")  # the Redis clock of the cell's master, the cell's pool
        assert health.status_code == 200 and health.json()["live_workers"] == 1, health.text
        assert (await http.post(f"{SESSIONS}/{sid}/close")).status_code == 200


async def test_dashboard_data_reads_the_cell(fleet: FleetClient, workers: WorkerPool) -> None:
    running = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    snapshot = await DashboardSource(fleet.scripts, lease_ms=fleet.lease_ms).snapshot()
    assert [(w["worker_id"], w["live"]) for w in snapshot["workers"]] == [(running.id, True)]
    assert snapshot["dead_letters"] == {"total": 0, "shown": []}
    assert snapshot["sessions"]["total"] == 1 and snapshot["sessions"]["orphaned"] == 0
