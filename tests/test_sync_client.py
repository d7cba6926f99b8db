"""The blocking facade, used from plain threads, against in-process workers."""

from __future__ import annotations

import asyncio

import pytest

from broker import SyncFleetClient
from broker.redis.embedded import RedisServer
from tests.support import WorkerPool, world_step
from workers.engines.null import NullEngine


@pytest.mark.asyncio
async def test_sync_client_steps_and_pipelines(redis_server: RedisServer, prefix: str, workers: WorkerPool) -> None:
    await workers.add(NullEngine())

    def trainer() -> list[int]:
        with SyncFleetClient(redis_server.url, prefix=prefix) as fleet:
            s = fleet.create_session(model="null-world", mode="world_model_env")
            first = s.step(0, **world_step(0))
            assert first.ok and first.committed_step_id == 0
            futures = [s.submit(i, **world_step(i)) for i in range(1, 8)]
            contexts = [f.result(30).output["context"] for f in futures]
            assert s.reset() == -1
            assert s.status().committed_step_id == -1
            s.close()
            return contexts

    assert await asyncio.to_thread(trainer) == list(range(1, 8))
