"""A world-model backend for RLinf's world-model envs on the fleet: action chunks in, frames out.

RLinf 0.3's world-model envs (``rlinf.envs.world_model``: ``WanEnv``, ``OpenSoraEnv``, both
``BaseWorldEnv`` subclasses) own their video model in process: ``chunk_step`` takes actions
``[B, T, A]`` (``T`` = ``chunk``), conditions on the last ``condition_frame_length`` frames and
appends frames ``[B, C, T, H, W]`` in [-1, 1] at ``image_size``. This backend gives such an env the
same call with the model on the fleet; ``broker.integrations.rlinf_env`` is the RLinf env built on it.

    backend = FleetWorldModelBackend(fleet, chunk=8, condition_frame_length=5, image_size=(64, 64))
    await backend.open_session(env_ids=[0, 1], init_frames=frames, init_actions=acts,
                               task_ids=["pick the cup", "open the drawer"], seeds=[0, 1])
    frames = await backend.generate([0, 1], actions)       # [2, 3, 8, 64, 64] float32 in [-1, 1]
    await backend.close_session([0, 1])

Each env slot is one ``world_model_env`` session; each action of a chunk is one fleet step, so a
chunk of ``T`` actions commits ``T`` steps in order, exactly once. Every step of a chunk carries the
chunk's conditioning: the slot's last frame (uint8 ``HxWx3`` image ``"image"``), its last action as
``state``, the task as ``prompt`` and the slot's seed in ``extra``; all ``B x T`` steps are
submitted at once, so the fleet batches across slots and pipelines within one. A step's
``video_latent`` (``[1, C, t, H, W]`` or ``[C, t, H, W]``) is squashed into [-1, 1] with ``tanh``
and the chunk's steps are joined on the time axis. A slot's step id advances per committed step:
after a failure (:class:`SlotStepError`) the caller re-sends only the actions that did not commit,
and they carry the failed chunk's conditioning (a slot's conditioning moves on when all of a
``generate`` call's actions committed), so the frames equal those of a chunk that never failed.

torch is imported only when torch tensors come in: a trainer installs this client light.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.client import FleetClient, Session
from broker.client.sync import SyncFleetClient
from schemas.errors import ErrorCode, FleetError
from schemas.messages import GRIPPER_COUNT, JOINT_COUNT, StepResult

DEFAULT_MODEL = "reference-world"
MODE = "world_model_env"
IMAGE_NAME = "image"


@dataclass(frozen=True)
class SlotFailure:
    env_id: int
    step_id: int
    committed: int  # actions of this chunk that committed before the failure
    code: ErrorCode
    message: str


class SlotStepError(FleetError):
    """Some slots' chunks failed. ``env_id`` / ``code`` name the first; ``failures`` all of them;
    ``completed`` holds the frames ``[C, k, H, W]`` of every slot's committed actions (``k`` of
    them; the slot's step id advanced by ``k``): re-send ``actions[:, k:]`` for a failed slot."""

    def __init__(self, failures: Sequence[SlotFailure], completed: Mapping[int, np.ndarray]) -> None:
        first = failures[0]
        others = f" (and {len(failures) - 1} more slots)" if len(failures) > 1 else ""
        super().__init__(f"env slot {first.env_id} step {first.step_id}: {first.message}{others}", code=first.code)
        self.env_id = first.env_id
        self.step_id = first.step_id
        self.failures = tuple(failures)
        self.completed = dict(completed)


def as_array(value: Any, name: str) -> np.ndarray:
    """numpy from a torch tensor (any device, bfloat16 included) or an array-like."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numeric: {exc}") from exc


def fleet_action(row: np.ndarray) -> dict[str, Any]:
    """One action of width 8 (7 joint positions + gripper) or 7 (joints) as a fleet action."""
    return {"joint_positions": row[:JOINT_COUNT].tolist(),
            "gripper_position": row[JOINT_COUNT:JOINT_COUNT + GRIPPER_COUNT].tolist() or None}


def chunk_actions(actions: Any, count: int) -> np.ndarray:
    """``[B, T, A]`` actions, checked: ``B`` slots, ``T >= 1``, ``A`` 7 or 8, finite."""
    array = as_array(actions, "actions")
    width = JOINT_COUNT + GRIPPER_COUNT
    if array.ndim != 3 or array.shape[0] != count or array.shape[1] < 1 or array.shape[2] not in (JOINT_COUNT, width):
        raise ValueError(f"actions must be [B={count}, T, {JOINT_COUNT} or {width}]; got {list(array.shape)}")
    if not np.isfinite(array).all():
        raise ValueError("actions must be finite")
    return array


def to_image(frame: np.ndarray) -> np.ndarray:
    """A ``[C=3, H, W]`` frame in [-1, 1] as the ``H x W x 3`` uint8 image a fleet step carries."""
    return np.ascontiguousarray((np.clip((frame + 1.0) / 2.0, 0.0, 1.0) * 255.0).round().astype(np.uint8)
                                .transpose(1, 2, 0))


def to_frames(latent: Any, image_size: tuple[int, int]) -> np.ndarray:
    """A step's ``video_latent`` as frames ``[C, t, H, W]`` in [-1, 1] (float32)."""
    if not isinstance(latent, np.ndarray):
        raise ValueError("the step result has no video_latent array")
    frames = latent[0] if latent.ndim == 5 and latent.shape[0] == 1 else latent
    if frames.ndim != 4 or tuple(frames.shape[2:]) != image_size:
        raise ValueError(f"video_latent {list(latent.shape)} is not [1, C, t, H, W] at image_size {list(image_size)}:"
                         " the world engine's latent shape must match the env's image_size")
    return np.tanh(frames.astype(np.float32))


@dataclass
class _Slot:
    session: Session
    step_id: int
    image: np.ndarray
    state: list[float]
    prompt: str
    seed: int | None

    def step(self, row: np.ndarray) -> dict[str, Any]:
        extra = {} if self.seed is None else {"seed": self.seed}
        return {"observation": {"prompt": self.prompt, "images": {IMAGE_NAME: self.image}, "state": self.state,
                                "extra": extra},
                "action": fleet_action(row)}


class FleetWorldModelBackend:
    """Async backend over a connected :class:`FleetClient`."""

    def __init__(self, fleet: FleetClient, *, chunk: int, condition_frame_length: int, image_size: Sequence[int],
                 model: str = DEFAULT_MODEL, step_timeout: float | None = None, result_window: int = 4) -> None:
        if chunk < 1 or condition_frame_length < 1 or len(image_size) != 2 or min(image_size) < 1:
            raise ValueError("chunk and condition_frame_length must be >= 1 and image_size (H, W) positive")
        self.fleet, self.model, self.step_timeout, self.result_window = fleet, model, step_timeout, result_window
        self.chunk, self.condition_frame_length = int(chunk), int(condition_frame_length)
        self.image_size: tuple[int, int] = (int(image_size[0]), int(image_size[1]))
        self._slots: dict[int, _Slot] = {}

    def session_id(self, env_id: int) -> str:
        return self._slots[int(env_id)].session.session_id

    def step_id(self, env_id: int) -> int:
        """The step id the slot's next action is sent as."""
        return self._slots[int(env_id)].step_id

    async def open_session(self, env_ids: Sequence[int], init_frames: Any, init_actions: Any = None,
                           task_ids: Sequence[Any] | None = None, seeds: Sequence[int] | None = None) -> None:
        """Start a trajectory per slot (a slot with a session gets a fresh one). ``init_frames``:
        ``[B, 3, To, H, W]`` in [-1, 1] (the last one conditions the first chunk); ``init_actions``:
        ``[B, To, A]`` (the last one is the first chunk's ``state``); ``task_ids``: one prompt per slot."""
        ids = _unique(env_ids)
        images, states = self._initial(len(ids), init_frames, init_actions)
        prompts = [""] * len(ids) if task_ids is None else [str(t) for t in task_ids]
        slot_seeds: list[int | None] = [None] * len(ids) if seeds is None else [int(s) for s in seeds]
        if len(prompts) != len(ids) or len(slot_seeds) != len(ids):
            raise ValueError(f"task_ids and seeds must name {len(ids)} env slots")
        await self.close_session(ids)
        sessions = await asyncio.gather(*(self.fleet.create_session(self.model, MODE, result_window=self.result_window)
                                          for _ in ids))
        for i, (env_id, session) in enumerate(zip(ids, sessions, strict=True)):
            self._slots[env_id] = _Slot(session, 0, images[i], states[i], prompts[i], slot_seeds[i])

    def _initial(self, count: int, init_frames: Any, init_actions: Any) -> tuple[list[np.ndarray], list[list[float]]]:
        frames = as_array(init_frames, "init_frames")
        if frames.ndim != 5 or frames.shape[0] != count or frames.shape[1] != 3 or frames.shape[2] < 1 \
                or tuple(frames.shape[3:]) != self.image_size:
            raise ValueError(f"init_frames must be [B={count}, 3, To, {self.image_size[0]}, {self.image_size[1]}];"
                             f" got {list(frames.shape)}")
        if init_actions is None:
            return [to_image(f[:, -1]) for f in frames], [[] for _ in range(count)]
        acts = as_array(init_actions, "init_actions")
        if acts.ndim != 3 or acts.shape[0] != count or acts.shape[1] < 1:
            raise ValueError(f"init_actions must be [B={count}, To, A]; got {list(acts.shape)}")
        return [to_image(f[:, -1]) for f in frames], [a[-1].tolist() for a in acts]

    async def generate(self, env_ids: Sequence[int], actions: Any) -> Any:
        """One chunk for every slot, submitted together: frames ``[B, C, T, H, W]`` float32 in [-1, 1]
        (a torch tensor when ``actions`` is one). Raises :class:`SlotStepError` if any slot failed."""
        ids = _unique(env_ids)
        missing = [e for e in ids if e not in self._slots]
        if missing:
            raise ValueError(f"generate called for env slots without a session: {missing}")
        array = chunk_actions(actions, len(ids))
        tasks = [[self._slots[e].session.submit(self._slots[e].step_id + t, timeout=self.step_timeout,
                                                **self._slots[e].step(row)) for t, row in enumerate(array[i])]
                 for i, e in enumerate(ids)]
        results = [await asyncio.gather(*slot_tasks) for slot_tasks in tasks]
        frames = self._take(ids, array, results)
        if hasattr(actions, "detach"):
            import torch  # lazy: only a caller that sent torch tensors gets one back

            return torch.from_numpy(frames)
        return frames

    def _take(self, ids: Sequence[int], actions: np.ndarray, results: Sequence[Sequence[StepResult]]) -> np.ndarray:
        completed: dict[int, np.ndarray] = {}
        failures: list[SlotFailure] = []
        for i, env_id in enumerate(ids):
            slot, parts, failed = self._slots[env_id], [], False
            for t, result in enumerate(results[i]):
                if not result.ok:
                    code = result.error.code if result.error else ErrorCode.INFERENCE_ERROR
                    message = result.error.message if result.error else "the step failed"
                    failures.append(SlotFailure(env_id, result.step_id, t, code, message))
                    failed = True
                    break
                parts.append(to_frames((result.output or {}).get("video_latent"), self.image_size))
                slot.step_id = result.step_id + 1
            if parts:
                completed[env_id] = np.concatenate(parts, axis=1)
            if parts and not failed:
                # The conditioning moves on only once the whole chunk committed, so re-sending the
                # rest of a failed chunk conditions it as the first try would have.
                slot.image, slot.state = to_image(completed[env_id][:, -1]), actions[i, -1].tolist()
        if failures:
            raise SlotStepError(failures, completed)
        return np.stack([completed[e] for e in ids], axis=0)

    async def close_session(self, env_ids: Sequence[int]) -> None:
        """End these slots' trajectories; slots without a session are ignored."""
        slots = [self._slots.pop(int(e), None) for e in env_ids]
        await asyncio.gather(*(s.session.close() for s in slots if s is not None))

    def offload(self) -> None:
        """No-op: the weights live on the workers."""

    def onload(self) -> None:
        """No-op: the weights live on the workers."""


def _unique(env_ids: Sequence[int]) -> list[int]:
    ids = [int(e) for e in env_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"env_ids has repeated slots: {ids}")
    return ids


class SyncFleetWorldModelBackend:
    """The same backend for RLinf's synchronous env workers, over a :class:`SyncFleetClient`.

    It drives a :class:`FleetWorldModelBackend` on the sync client's event loop, so both share
    one implementation; each call blocks until the async one is done and raises what it raises.
    """

    def __init__(self, fleet: SyncFleetClient, *, chunk: int, condition_frame_length: int, image_size: Sequence[int],
                 model: str = DEFAULT_MODEL, step_timeout: float | None = None, result_window: int = 4) -> None:
        self.fleet = fleet
        self.backend = FleetWorldModelBackend(fleet.client, chunk=chunk, condition_frame_length=condition_frame_length,
                                              image_size=image_size, model=model, step_timeout=step_timeout,
                                              result_window=result_window)
        self.chunk, self.condition_frame_length = self.backend.chunk, self.backend.condition_frame_length
        self.image_size = self.backend.image_size

    @property
    def model(self) -> str:
        return self.backend.model

    def session_id(self, env_id: int) -> str:
        return self.backend.session_id(env_id)

    def step_id(self, env_id: int) -> int:
        """The step id the slot's next action is sent as."""
        return self.backend.step_id(env_id)

    def open_session(self, env_ids: Sequence[int], init_frames: Any, init_actions: Any = None,
                     task_ids: Sequence[Any] | None = None, seeds: Sequence[int] | None = None) -> None:
        self.fleet.call(self.backend.open_session(env_ids, init_frames, init_actions, task_ids, seeds))

    def generate(self, env_ids: Sequence[int], actions: Any) -> Any:
        return self.fleet.call(self.backend.generate(env_ids, actions))

    def close_session(self, env_ids: Sequence[int]) -> None:
        self.fleet.call(self.backend.close_session(env_ids))

    def offload(self) -> None:
        """No-op: the weights live on the workers."""

    def onload(self) -> None:
        """No-op: the weights live on the workers."""
