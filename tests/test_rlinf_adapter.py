"""The RLinf-style world-model backend on a real fleet: batched latents equal per-slot steps."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from broker import FleetClient, SyncFleetClient
from broker.integrations.rlinf import FleetWorldModelBackend, SlotStepError, SyncFleetWorldModelBackend
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode
from tests.support import WorkerPool, image
from tests.test_multiturn import reference_engine

SLOTS = [3, 0, 7]


def actions(step: int) -> np.ndarray:
    return np.array([[0.1 * ((step + slot + j) % 5) for j in range(7)] + [0.5] for slot in SLOTS])


def observation(slot: int, step: int) -> dict[str, Any]:
    return {"prompt": f"pick the cup {slot}", "images": {"observation/exterior_image_1_left": image(slot * 10 + step)},
            "state": [0.01 * step] * 8}


def batched(step: int) -> dict[str, Any]:
    rows = [observation(slot, step) for slot in SLOTS]
    return {"prompt": [r["prompt"] for r in rows],
            "images": {"observation/exterior_image_1_left": np.stack([r["images"]["observation/exterior_image_1_left"]
                                                                     for r in rows])},
            "state": np.array([r["state"] for r in rows])}


async def per_slot_latents(fleet: FleetClient, steps: int) -> dict[int, list[np.ndarray]]:
    out: dict[int, list[np.ndarray]] = {}
    for row, slot in enumerate(SLOTS):
        session = await fleet.create_session(model="reference-world", mode="world_model_env")
        results = [await session.step(i, observation=observation(slot, i),
                                      action={"joint_positions": actions(i)[row][:7].tolist(),
                                              "gripper_position": [0.5]}) for i in range(steps)]
        assert all(r.ok for r in results)
        out[slot] = [r.output["video_latent"] for r in results]  # type: ignore[index]
        await session.close()
    return out


async def test_batched_latents_equal_per_slot_fleet_steps(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    await workers.add(reference_engine())
    backend = FleetWorldModelBackend(fleet)
    await backend.open_session(SLOTS)
    batches = []
    for i in range(3):
        obs = batched(i) if i % 2 else [observation(slot, i) for slot in SLOTS]
        batches.append(await backend.generate(SLOTS, actions(i), obs))
    expected = await per_slot_latents(fleet, 3)
    for i, batch in enumerate(batches):
        assert batch.shape == (len(SLOTS), 4, 2, 8, 10) and batch.dtype == np.float32
        for row, slot in enumerate(SLOTS):
            assert batch[row].tobytes() == expected[slot][i][0].tobytes()
    assert [backend.step_id(slot) for slot in SLOTS] == [3, 3, 3]
    sessions = [backend.session_id(slot) for slot in SLOTS]
    assert [(await fleet.status(sid)).committed_step_id for sid in sessions] == [2, 2, 2]
    await backend.close_session([*SLOTS, 99])  # unknown slots are ignored
    assert [(await fleet.status(sid)).closed for sid in sessions] == [True, True, True]


async def test_a_failed_slot_raises_and_only_it_is_resent(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    backend = FleetWorldModelBackend(fleet)
    await backend.open_session(SLOTS)
    bad = [observation(slot, 0) for slot in SLOTS]
    bad[1]["images"] = {"cam": np.zeros((4, 4, 3), np.float32)}
    with pytest.raises(SlotStepError) as info:
        await backend.generate(SLOTS, actions(0), bad)
    error = info.value
    assert error.env_id == 0 and error.code is ErrorCode.INVALID_REQUEST and error.step_id == 0
    assert sorted(error.completed) == [3, 7]
    assert [backend.step_id(slot) for slot in SLOTS] == [1, 0, 1]
    retry = await backend.generate([0], actions(0)[1:2], [observation(0, 0)])
    assert retry.shape == (1, 4, 2, 8, 10) and backend.step_id(0) == 1
    with pytest.raises(ValueError, match="without a session"):
        await backend.generate([5], actions(0)[:1], [observation(5, 0)])
    with pytest.raises(ValueError, match="repeated"):
        await backend.generate([0, 0], actions(0)[:2], [observation(0, 0)] * 2)
    with pytest.raises(ValueError, match="actions must be"):
        await backend.generate(SLOTS, np.zeros((3, 2, 8)), [observation(s, 0) for s in SLOTS])
    await backend.close_session(SLOTS)


async def test_sync_backend_for_rlinf_env_workers(redis_server: RedisServer, prefix: str, fleet: FleetClient,
                                                  workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sync = SyncFleetClient(redis_server.url, prefix=prefix)
    await asyncio.to_thread(sync.connect)
    try:
        backend = SyncFleetWorldModelBackend(sync)
        await asyncio.to_thread(backend.open_session, SLOTS)
        batch = await asyncio.to_thread(backend.generate, SLOTS, actions(0), batched(0))
        expected = await per_slot_latents(fleet, 1)
        for row, slot in enumerate(SLOTS):
            assert batch[row].tobytes() == expected[slot][0][0].tobytes()
        assert backend.step_id(SLOTS[0]) == 1
        backend.onload()
        backend.offload()
        await asyncio.to_thread(backend.close_session, SLOTS)
    finally:
        await asyncio.to_thread(sync.close)
