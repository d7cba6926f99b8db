"""RLinf's world-model env with its video model on the fleet: ``FleetWorldEnv``, an
``rlinf.envs.world_model.base_world_env.BaseWorldEnv`` subclass (RLinf 0.3).

RLinf's EnvWorker builds an env as ``env_cls(cfg=, num_envs=, seed_offset=, total_num_processes=,
worker_info=)`` and drives it with ``reset()`` and ``chunk_step(actions [B, chunk, A])``, which
returns ``([obs], rewards [B, chunk], terminations, truncations, [infos])``; ``obs`` is RLinf's
libero layout (``main_images`` uint8 ``[B, H, W, 3]``, ``wrist_images``, ``states``,
``task_descriptions``). ``FleetWorldEnv`` keeps that contract and sends each chunk through
:class:`broker.integrations.rlinf.SyncFleetWorldModelBackend`. Its env config (RLinf's
``env.train`` / ``env.eval``) adds a ``fleet`` block to what RLinf's world-model envs read::

    env_type: wan_wm            # an RLinf world-model type, so its action preparation applies
    wm_env_type: libero
    chunk: 8
    condition_frame_length: 5
    image_size: [64, 64]        # must match the world engine's latent H, W
    max_episode_steps: 64
    initial_image_path: /data/starts   # *.npz: image [3, H, W] in [0, 1], task (a string)
    fleet: {url: "redis://fleet:6379", prefix: rf, model: reference-world, step_timeout_s: 120}

RLinf 0.3 resolves ``env_type`` through a closed list (``rlinf.envs.get_env_cls``); :func:`install`
wraps it so a config with a ``fleet`` block gets ``FleetWorldEnv``. Rewards are zero: RLinf's
world-model envs score frames with their own reward model, which is not part of the fleet.
rlinf and torch are imported when ``FleetWorldEnv`` is first used, so this module imports without them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from broker.client.sync import SyncFleetClient
from broker.integrations.rlinf import DEFAULT_MODEL, SyncFleetWorldModelBackend

CONFIG_KEY = "fleet"
STATE_WIDTH = 16  # RLinf's world-model envs report a zero state of this width (WanEnv._wrap_obs)


def load_starts(path: str, image_size: tuple[int, int]) -> list[dict[str, Any]]:
    """Episode starts from ``*.npz`` files (no pickle): ``image`` ``[3, H, W]`` in [0, 1] at
    ``image_size`` (the layout of RLinf's world-model datasets) and ``task``."""
    files = sorted(Path(path).glob("*.npz"))
    if not files:
        raise ValueError(f"no *.npz episode starts in {path}")
    starts = []
    for file in files:
        with np.load(file, allow_pickle=False) as data:
            image = np.asarray(data["image"], dtype=np.float32)
            task = str(data["task"]) if "task" in data else ""
        if image.shape != (3, *image_size):
            raise ValueError(f"{file.name}: image must be [3, {image_size[0]}, {image_size[1]}];"
                             f" got {list(image.shape)}")
        starts.append({"image": image, "task": task})
    return starts


def _init(self: Any, cfg: Any, num_envs: int, seed_offset: int, total_num_processes: int,
          record_metrics: bool = True, worker_info: Any = None) -> None:
    self.chunk, self.condition_frame_length = int(cfg.chunk), int(cfg.condition_frame_length)
    self.image_size = (int(cfg.image_size[0]), int(cfg.image_size[1]))
    self.action_dim = int(cfg.get("action_dim", 7))
    from rlinf.envs.world_model.base_world_env import BaseWorldEnv

    BaseWorldEnv.__init__(self, cfg, num_envs, seed_offset, total_num_processes, worker_info, record_metrics)
    fleet = cfg[CONFIG_KEY]
    self.fleet = SyncFleetClient(str(fleet.url), prefix=str(fleet.get("prefix", "rf")))
    self.fleet.connect()
    timeout = fleet.get("step_timeout_s", None)
    self.backend = SyncFleetWorldModelBackend(
        self.fleet, chunk=self.chunk, condition_frame_length=self.condition_frame_length, image_size=self.image_size,
        model=str(fleet.get("model", DEFAULT_MODEL)), step_timeout=None if timeout is None else float(timeout),
        result_window=int(fleet.get("result_window", 4)))
    self._rng = np.random.default_rng(self.seed)
    self.current_obs = None
    self.task_descriptions = [""] * num_envs


def _build_dataset(self: Any, cfg: Any) -> list[dict[str, Any]]:
    return load_starts(str(cfg.initial_image_path), (int(cfg.image_size[0]), int(cfg.image_size[1])))


def _reset(self: Any, *, seed: int | None = None, options: dict[str, Any] | None = None,
           episode_indices: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """New episodes for every env slot: one fleet session each, conditioned on its start frame."""
    import torch

    if episode_indices is None:
        rng = self._rng if seed is None else np.random.default_rng(seed)
        episode_indices = rng.choice(len(self.dataset), size=self.num_envs, replace=len(self.dataset) < self.num_envs)
    starts = [self.dataset[int(i)] for i in np.asarray(episode_indices).reshape(-1)]
    if len(starts) != self.num_envs:
        raise ValueError(f"{len(starts)} episode indices for {self.num_envs} envs")
    frames = np.stack([s["image"] * 2.0 - 1.0 for s in starts])[:, :, None].repeat(self.condition_frame_length, 2)
    actions = np.zeros((self.num_envs, self.condition_frame_length, self.action_dim), np.float32)
    self.task_descriptions = [s["task"] for s in starts]
    self.backend.open_session(env_ids=list(range(self.num_envs)), init_frames=frames, init_actions=actions,
                              task_ids=self.task_descriptions,
                              seeds=[(self.seed * self.num_envs + i) % 2**63 for i in range(self.num_envs)])
    self.current_obs = torch.from_numpy(frames.astype(np.float32))
    self.elapsed_steps = 0
    self._reset_metrics()
    return _wrap_obs(self), {}


def _wrap_obs(self: Any) -> dict[str, Any]:
    import torch

    last = self.current_obs[:, :, -1].permute(0, 2, 3, 1)  # [B, H, W, 3] in [-1, 1]
    images = torch.clamp((last + 1.0) / 2.0 * 255.0, 0, 255).round().to(torch.uint8)
    return {"main_images": images, "wrist_images": None,
            "states": torch.zeros((self.num_envs, STATE_WIDTH), dtype=torch.float32),
            "task_descriptions": list(self.task_descriptions)}


def _chunk_step(self: Any, actions: Any) -> tuple[list[dict[str, Any]], Any, Any, Any, list[dict[str, Any]]]:
    """One chunk on the fleet; the same five outputs as RLinf's world-model envs."""
    import torch

    if not isinstance(actions, torch.Tensor):
        actions = torch.as_tensor(np.asarray(actions, dtype=np.float32))
    if actions.ndim != 3 or actions.shape[1] != self.chunk:
        raise ValueError(f"actions must be [num_envs, chunk={self.chunk}, A]; got {list(actions.shape)}")
    frames = self.backend.generate(list(range(self.num_envs)), actions)
    keep = self.condition_frame_length + self.chunk
    self.current_obs = torch.cat([self.current_obs, frames], dim=2)[:, :, -keep:]
    self.elapsed_steps += int(actions.shape[1])
    obs = _wrap_obs(self)
    rewards = torch.zeros((self.num_envs, self.chunk), dtype=torch.float32)
    terminations = torch.zeros((self.num_envs, self.chunk), dtype=torch.bool)
    truncations = torch.zeros_like(terminations)
    truncations[:, -1] = self.elapsed_steps >= int(self.cfg.max_episode_steps)
    dones = truncations.any(dim=1)
    infos: dict[str, Any] = {}
    if dones.any() and self.auto_reset:
        final_obs = obs
        obs, infos = _reset(self)
        infos.update({"final_observation": final_obs, "final_info": {}, "_final_info": dones,
                      "_final_observation": dones, "_elapsed_steps": dones})
    infos = self._record_metrics(rewards.sum(dim=1), terminations.any(dim=1), infos)
    return [obs], rewards, terminations, truncations, [infos]


def _step(self: Any, actions: Any = None, auto_reset: bool = True) -> Any:
    raise NotImplementedError("FleetWorldEnv steps whole chunks: use chunk_step, as RLinf's world-model envs do")


def _close(self: Any) -> None:
    """End the slots' sessions and disconnect (RLinf never calls this; a test or a script does)."""
    self.backend.close_session(list(range(self.num_envs)))
    self.fleet.close()


def _no_op(self: Any) -> None:
    """offload / onload: the weights live on the fleet's workers."""


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``FleetWorldEnv``, built (importing rlinf) on first use."""
    if name != "FleetWorldEnv":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        from rlinf.envs.world_model.base_world_env import BaseWorldEnv

        body = {"__init__": _init, "_build_dataset": _build_dataset, "reset": _reset, "chunk_step": _chunk_step,
                "step": _step, "close": _close, "offload": _no_op, "onload": _no_op, "__module__": __name__,
                "__doc__": "RLinf's BaseWorldEnv with its video model on the fleet."}
        cls = type(name, (BaseWorldEnv,), body)
        cls.__qualname__ = name
        _BUILT[name] = cls
    return _BUILT[name]


def install() -> None:
    """Wrap ``rlinf.envs.get_env_cls`` (and the EnvWorker's imported copy, when loaded) so an env
    config with a ``fleet`` block resolves to ``FleetWorldEnv``; every other config is unchanged.
    Run it in the process that runs RLinf's EnvWorker, before the worker builds its envs."""
    import rlinf.envs

    original = rlinf.envs.get_env_cls
    if getattr(original, "_fleet_wrapped", False):
        return

    def get_env_cls(env_type: str, env_cfg: Any = None) -> Any:
        if env_cfg is not None and env_cfg.get(CONFIG_KEY) is not None:
            return __getattr__("FleetWorldEnv")
        return original(env_type, env_cfg)

    get_env_cls._fleet_wrapped = True  # type: ignore[attr-defined]
    rlinf.envs.get_env_cls = get_env_cls
    worker = sys.modules.get("rlinf.workers.env.env_worker")
    if worker is not None:
        worker.get_env_cls = get_env_cls  # type: ignore[attr-defined]
