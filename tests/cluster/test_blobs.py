"""Large results on a Redis Cluster: the staging SET and the commit reach the cell's master on one
connection (pipelined with other commits, or with the WAIT of replicated durability), and the
trainer reads the blobs back through a client pointed at any node."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.redis.blobs import STAGE_BYTES, blob_key
from broker.redis.inputs import STAGED, read_record_inputs
from broker.redis.layouts import log_result_field
from tests.support import WorkerPool, world_step
from tests.test_input_blobs import large_step
from workers.engines.null import NullEngine, NullEngineConfig

pytestmark = pytest.mark.cluster
LATENT = (1, 16, 2, 44, 80)


@pytest.mark.parametrize("durability", ["async", "replicated"])
async def test_latent_results_travel_as_blobs(fleet: FleetClient, workers: WorkerPool, durability: str) -> None:
    await workers.add(NullEngine(NullEngineConfig(latent_shape=LATENT)), durability=durability)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
                for _ in range(3)]
    # several sessions at once: their commits leave in one pipeline, each behind its staging SET
    results = await asyncio.gather(*[s.submit(i, **world_step(i)) for s in sessions for i in range(3)])
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.output["video_latent"].nbytes >= STAGE_BYTES for r in results)
    s = sessions[0]
    keys = fleet.keys_of(s.session_id)
    stored = await fleet.redis.hget(keys.log(s.session_id), log_result_field(2, 2))
    assert blob_key(stored) == keys.result_blob(s.session_id, 2)
    assert not await fleet.redis.exists(keys.result_blob(s.session_id, 0))  # left the window of 2
    again = await s.step(2, **world_step(2))
    assert again.ok and again.duplicate
    assert np.array_equal(again.output["video_latent"], results[2].output["video_latent"])


@pytest.mark.parametrize("durability", ["async", "replicated"])
async def test_large_observations_are_staged_and_kept_with_their_records(
    fleet: FleetClient, workers: WorkerPool, durability: str
) -> None:
    """Staged step payloads (broker/redis/inputs.py) on a cluster: the staging SET and enqueue.lua
    reach the cell's master together, commit.lua moves each input to its record blob, and no input
    blob outlives its step."""
    await workers.add(NullEngine(NullEngineConfig(latent_shape=(1, 4))), durability=durability)
    sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(3)]
    results = await asyncio.gather(*[s.submit(i, **large_step(i)) for s in sessions for i in range(3)])
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for s in sessions:
        keys = fleet.keys_of(s.session_id)
        for step in range(3):
            assert await fleet.redis.strlen(keys.record_blob(s.session_id, step)) >= STAGE_BYTES
        assert [key async for key in fleet.redis.scan_iter(match=keys.log(s.session_id) + ":in:*")] == []
        records: list[tuple[int, dict[str, Any]]] = [(step, {"payload": STAGED}) for step in range(3)]
        await read_record_inputs(fleet.redis, keys, s.session_id, records)  # a rebuild's one MGET
        assert [len(record["payload"]) >= STAGE_BYTES for _, record in records] == [True] * 3
