"""The world-model backend for RLinf's envs on a real fleet: chunked frames equal per-action steps."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker import FleetClient, SyncFleetClient
from broker.integrations.rlinf import FleetWorldModelBackend, SlotStepError, SyncFleetWorldModelBackend
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode
from tests.support import WorkerPool
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

SLOTS = [3, 0, 7]
SIZE = (8, 8)
CHUNK, TO = 3, 2
ROOT = Path(__file__).resolve().parent.parent
TASKS = ["pick the cup", "open the drawer", "stack the blocks"]
SEEDS = [11, 12, 13]


def frame_engine() -> ReferenceEngine:
    """Latents of one 3-channel frame at SIZE per step: the layout RLinf's envs read as frames."""
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=(1, 3, 1, *SIZE)))


def init_frames() -> np.ndarray:
    rng = np.random.default_rng(5)
    return rng.uniform(-1.0, 1.0, size=(len(SLOTS), 3, TO, *SIZE)).astype(np.float32)


def init_actions() -> np.ndarray:
    return np.full((len(SLOTS), TO, 8), 0.25)


def chunk(index: int) -> np.ndarray:
    """Actions [B, CHUNK, 8]: 7 joint positions + gripper, distinct per slot, step and chunk."""
    return np.array([[[0.1 * ((index * CHUNK + t + slot + j) % 5) for j in range(7)] + [0.5] for t in range(CHUNK)]
                     for slot in SLOTS])


def as_image(frame: np.ndarray) -> np.ndarray:
    return ((np.clip((frame + 1.0) / 2.0, 0.0, 1.0) * 255.0).round().astype(np.uint8)).transpose(1, 2, 0)


async def expected_frames(fleet: FleetClient, chunks: list[np.ndarray]) -> np.ndarray:
    """What the backend's contract says, one action at a time: each chunk's steps carry the slot's
    last frame, its last action as state, its task and seed; frames are tanh(latent)."""
    per_slot = []
    for row, slot in enumerate(SLOTS):
        session = await fleet.create_session(model="reference-world", mode="world_model_env")
        image, state, frames, step = as_image(init_frames()[row][:, -1]), init_actions()[row][-1].tolist(), [], 0
        for actions in chunks:
            for action in actions[row]:
                result = await session.step(step, observation={"prompt": TASKS[row], "images": {"image": image},
                                                               "state": state, "extra": {"seed": SEEDS[row]}},
                                            action={"joint_positions": action[:7].tolist(),
                                                    "gripper_position": action[7:].tolist()})
                assert result.ok, (slot, result.error)
                frames.append(np.tanh(result.output["video_latent"][0]))  # type: ignore[index]
                step += 1
            image, state = as_image(frames[-1][:, -1]), actions[row][-1].tolist()
        per_slot.append(np.concatenate(frames, axis=1))
        await session.close()
    return np.stack(per_slot)


async def open_backend(fleet: FleetClient) -> FleetWorldModelBackend:
    backend = FleetWorldModelBackend(fleet, chunk=CHUNK, condition_frame_length=TO, image_size=SIZE)
    await backend.open_session(env_ids=SLOTS, init_frames=init_frames(), init_actions=init_actions(),
                               task_ids=TASKS, seeds=SEEDS)
    return backend


async def test_chunked_frames_equal_per_action_fleet_steps(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(frame_engine())
    await workers.add(frame_engine())
    backend = await open_backend(fleet)
    assert (backend.chunk, backend.condition_frame_length, backend.image_size) == (CHUNK, TO, SIZE)
    out = [await backend.generate(SLOTS, chunk(i)) for i in range(2)]
    expected = await expected_frames(fleet, [chunk(0), chunk(1)])
    for i, frames in enumerate(out):
        assert frames.shape == (len(SLOTS), 3, CHUNK, *SIZE) and frames.dtype == np.float32
        assert frames.min() >= -1.0 and frames.max() <= 1.0
        assert frames.tobytes() == expected[:, :, i * CHUNK:(i + 1) * CHUNK].astype(np.float32).tobytes()
    assert [backend.step_id(slot) for slot in SLOTS] == [6, 6, 6]
    sessions = [backend.session_id(slot) for slot in SLOTS]
    assert [(await fleet.status(sid)).committed_step_id for sid in sessions] == [5, 5, 5]
    await backend.close_session([*SLOTS, 99])  # unknown slots are ignored
    assert [(await fleet.status(sid)).closed for sid in sessions] == [True, True, True]


async def test_a_failed_action_raises_and_only_the_rest_is_resent(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(frame_engine())
    backend = await open_backend(fleet)
    bad = chunk(0)
    bad[1, 1, 0] = 1e6  # the reference world rejects joint values beyond its bound: invalid_request
    with pytest.raises(SlotStepError) as info:
        await backend.generate(SLOTS, bad)
    error = info.value
    assert (error.env_id, error.step_id, error.code) == (0, 1, ErrorCode.INVALID_REQUEST)
    assert [(f.env_id, f.committed) for f in error.failures] == [(0, 1)]
    assert sorted(error.completed) == [0, 3, 7] and error.completed[0].shape == (3, 1, *SIZE)
    assert [backend.step_id(slot) for slot in SLOTS] == [3, 1, 3]
    retry = await backend.generate([0], chunk(0)[1:2, 1:])
    assert retry.shape == (1, 3, CHUNK - 1, *SIZE) and backend.step_id(0) == 3
    expected = await expected_frames(fleet, [chunk(0)])
    assert np.concatenate([error.completed[0], retry[0]], axis=1).tobytes() == expected[1].astype(np.float32).tobytes()
    await backend.close_session(SLOTS)


async def test_bad_input_is_refused_before_anything_is_sent(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(frame_engine())
    backend = await open_backend(fleet)
    with pytest.raises(ValueError, match="without a session"):
        await backend.generate([5], chunk(0)[:1])
    with pytest.raises(ValueError, match="repeated"):
        await backend.generate([0, 0], chunk(0)[:2])
    with pytest.raises(ValueError, match="actions must be"):
        await backend.generate(SLOTS, np.zeros((3, 2, 5)))
    with pytest.raises(ValueError, match="finite"):
        await backend.generate(SLOTS, np.full((3, 2, 8), np.nan))
    with pytest.raises(ValueError, match="init_frames must be"):
        await backend.open_session(env_ids=[9], init_frames=np.zeros((1, 3, TO, 4, 4)))
    assert [backend.step_id(slot) for slot in SLOTS] == [0, 0, 0]
    assert [(await fleet.status(backend.session_id(s))).committed_step_id for s in SLOTS] == [-1, -1, -1]
    await backend.close_session(SLOTS)


async def test_an_engine_latent_off_the_image_size_is_named(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ReferenceEngine(ReferenceEngineConfig(latent_shape=(1, 4, 2, 8, 10))))
    backend = FleetWorldModelBackend(fleet, chunk=1, condition_frame_length=1, image_size=SIZE)
    await backend.open_session(env_ids=[0], init_frames=np.zeros((1, 3, 1, *SIZE)))
    with pytest.raises(ValueError, match="image_size"):
        await backend.generate([0], np.zeros((1, 1, 8)))
    await backend.close_session([0])


async def test_sync_backend_takes_and_returns_torch(redis_server: RedisServer, prefix: str, fleet: FleetClient,
                                                   workers: WorkerPool) -> None:
    import torch

    await workers.add(frame_engine())
    sync = SyncFleetClient(redis_server.url, prefix=prefix)
    await asyncio.to_thread(sync.connect)
    try:
        backend = SyncFleetWorldModelBackend(sync, chunk=CHUNK, condition_frame_length=TO, image_size=SIZE)
        await asyncio.to_thread(backend.open_session, SLOTS, torch.from_numpy(init_frames()),
                                torch.from_numpy(init_actions()), TASKS, SEEDS)
        frames = await asyncio.to_thread(backend.generate, SLOTS, torch.from_numpy(chunk(0)).to(torch.bfloat16))
        assert isinstance(frames, torch.Tensor) and frames.dtype == torch.float32
        bf16: Any = torch.from_numpy(chunk(0)).to(torch.bfloat16).float().numpy()
        expected = await expected_frames(fleet, [bf16])
        assert frames.numpy().tobytes() == expected.astype(np.float32).tobytes()
        assert backend.step_id(SLOTS[0]) == CHUNK and backend.image_size == SIZE
        backend.onload()
        backend.offload()
        await asyncio.to_thread(backend.close_session, SLOTS)
    finally:
        await asyncio.to_thread(sync.close)


def test_the_client_side_imports_without_torch_or_rlinf() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['rlinf'] = None\n"
            "import broker.integrations.rlinf, broker.integrations.rlinf_env\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
