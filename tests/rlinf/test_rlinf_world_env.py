"""RLinf 0.3's own classes with the fleet as the world model: ``FleetWorldEnv`` (a subclass of RLinf's
``BaseWorldEnv``) built as RLinf's EnvWorker builds it, through ``rlinf.envs.get_env_cls`` once
:func:`install` wrapped it, and driven as the EnvWorker drives it: ``reset``, then RLinf's
``prepare_actions`` (the ``wan_wm`` / libero path) before every ``chunk_step``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.integrations import rlinf_env
from broker.integrations.rlinf import FleetWorldModelBackend
from broker.redis.embedded import RedisServer
from tests.rlinf.conftest import requires_rlinf
from tests.support import WorkerPool
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

pytestmark = [pytest.mark.rlinf, requires_rlinf]

NUM_ENVS, CHUNK, TO, SIZE, STEPS = 3, 4, 2, (16, 16), 8
TASKS = ["pick the cup", "open the drawer", "stack the blocks", "push the button"]


@pytest.fixture
def starts(tmp_path: Path) -> Path:
    """Episode starts as RLinf's world-model datasets hold them: image [3, H, W] in [0, 1], task."""
    rng = np.random.default_rng(3)
    for i, task in enumerate(TASKS):
        np.savez(tmp_path / f"episode_{i}.npz", image=rng.uniform(0, 1, (3, *SIZE)).astype(np.float32), task=task)
    return tmp_path


def env_config(redis_server: RedisServer, prefix: str, starts: Path) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "env_type": "wan_wm", "wm_env_type": "libero", "seed": 7, "auto_reset": True, "max_episode_steps": STEPS,
        "video_cfg": {"save_video": False}, "chunk": CHUNK, "condition_frame_length": TO, "image_size": list(SIZE),
        "initial_image_path": str(starts),
        "fleet": {"url": redis_server.url, "prefix": prefix, "model": "reference-world", "step_timeout_s": 120}})


@pytest.fixture
def installed() -> Iterator[Any]:
    import rlinf.envs

    original = rlinf.envs.get_env_cls
    rlinf_env.install()
    yield rlinf.envs
    rlinf.envs.get_env_cls = original


def policy_actions(step: int) -> Any:
    """What a policy emits: [num_envs, chunk, 7] (LIBERO: 6 end-effector deltas + gripper in [0, 1])."""
    import torch

    values = [[[0.1 * ((step + t + env + j) % 5) for j in range(6)] + [float((step + env) % 2)] for t in range(CHUNK)]
              for env in range(NUM_ENVS)]
    return torch.tensor(values, dtype=torch.float32)


def prepared(step: int) -> Any:
    from rlinf.envs.action_utils import prepare_actions

    return prepare_actions(raw_chunk_actions=policy_actions(step), env_type="wan_wm", model_type="openvla_oft",
                           num_action_chunks=CHUNK, action_dim=7, wm_env_type="libero")


def test_fleet_world_env_is_an_rlinf_world_env(installed: Any, redis_server: RedisServer, prefix: str,
                                               starts: Path) -> None:
    from rlinf.envs.world_model.base_world_env import BaseWorldEnv

    cls = installed.get_env_cls("wan_wm", env_config(redis_server, prefix, starts))
    assert cls is rlinf_env.FleetWorldEnv and issubclass(cls, BaseWorldEnv) and not cls.__abstractmethods__
    rlinf_env.install()  # a second install keeps one wrapper
    with pytest.raises(ValueError, match="not_an_env"):  # configs without a fleet block reach RLinf's own lookup
        installed.get_env_cls("not_an_env", {"fleet": None})


async def test_rlinf_env_loop_on_the_fleet(installed: Any, redis_server: RedisServer, prefix: str, starts: Path,
                                           fleet: FleetClient, workers: WorkerPool) -> None:
    import torch

    await workers.add(ReferenceEngine(ReferenceEngineConfig(latent_shape=(1, 3, 1, *SIZE))))
    cfg = env_config(redis_server, prefix, starts)
    env_cls = installed.get_env_cls(cfg.env_type, cfg)
    env = await asyncio.to_thread(env_cls, cfg=cfg, num_envs=NUM_ENVS, seed_offset=0, total_num_processes=1,
                                  worker_info=None)
    try:
        obs, infos = await asyncio.to_thread(env.reset)
        assert infos == {} and obs["task_descriptions"] == env.task_descriptions
        first = [env.backend.session_id(i) for i in range(NUM_ENVS)]
        mirror = await mirror_backend(fleet, env)
        for k in range(STEPS // CHUNK):
            actions = prepared(k)
            out, rewards, terms, truncs, infos_list = await asyncio.to_thread(env.chunk_step, actions)
            frames = await mirror.generate(list(range(NUM_ENVS)), torch.as_tensor(actions))
            final = infos_list[-1].get("final_observation", out[-1])
            assert torch.equal(final["main_images"], as_uint8(frames[:, :, -1]))
            assert out[-1]["main_images"].shape == (NUM_ENVS, *SIZE, 3) and out[-1]["main_images"].dtype == torch.uint8
            assert rewards.shape == terms.shape == truncs.shape == (NUM_ENVS, CHUNK)
            assert truncs[:, -1].tolist() == [k == STEPS // CHUNK - 1] * NUM_ENVS
        assert [(await fleet.status(sid)).committed_step_id for sid in first] == [STEPS - 1] * NUM_ENVS
        assert set(infos_list[-1]) >= {"final_observation", "episode"}  # RLinf's auto-reset and metrics fields
        assert [env.backend.step_id(i) for i in range(NUM_ENVS)] == [0] * NUM_ENVS  # auto reset: fresh sessions
        assert not {env.backend.session_id(i) for i in range(NUM_ENVS)} & set(first)
        await mirror.close_session(list(range(NUM_ENVS)))
    finally:
        await asyncio.to_thread(env.close)


async def mirror_backend(fleet: FleetClient, env: Any) -> FleetWorldModelBackend:
    """The backend called directly with what the env sent at reset: the env's frames must equal it."""
    backend = FleetWorldModelBackend(fleet, chunk=CHUNK, condition_frame_length=TO, image_size=SIZE)
    await backend.open_session(env_ids=list(range(NUM_ENVS)), init_frames=env.current_obs,
                               init_actions=np.zeros((NUM_ENVS, TO, 7)), task_ids=env.task_descriptions,
                               seeds=[(env.seed * NUM_ENVS + i) % 2**63 for i in range(NUM_ENVS)])
    return backend


def as_uint8(frames: Any) -> Any:
    import torch

    return torch.clamp((frames.permute(0, 2, 3, 1) + 1.0) / 2.0 * 255.0, 0, 255).round().to(torch.uint8)
