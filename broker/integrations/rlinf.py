"""An RLinf-style world-model backend on the fleet: env slots in, batched latents out.

Each env slot maps to one ``world_model_env`` session. ``generate`` submits every slot's step at
once (``Session.submit``), so the fleet batches them across workers, and returns the latents
stacked in ``env_ids`` order. The backend tracks each slot's step id; a slot's step id advances
only when that slot's step committed, so re-sending after an error never steps a slot twice.

    backend = FleetWorldModelBackend(fleet)            # async; SyncFleetWorldModelBackend for RLinf
    await backend.open_session([0, 1, 2])
    latents = await backend.generate([0, 1, 2], actions, observations)   # (3, C, T, H, W)
    await backend.close_session([0, 1, 2])

``actions``: ``(B, 8)`` (7 joint positions + gripper), ``(B, 7)``, ``(B, 1, 8|7)``, or one action
mapping per slot. ``observations``: one mapping per slot (``prompt``, ``images`` {name: HxWx3
uint8}, ``state``, ``extra``), or one batched mapping (``prompt`` str or B strings, ``images``
{name: (B, H, W, 3)}, ``state`` (B, S)). A latent with a leading axis of 1 (the engines' layout)
is concatenated on that axis; any other is stacked on a new one.
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


@dataclass(frozen=True)
class SlotFailure:
    env_id: int
    step_id: int
    code: ErrorCode
    message: str


class SlotStepError(FleetError):
    """Some slots' steps failed. ``env_id`` / ``code`` name the first; ``failures`` all of them;
    ``completed`` holds the latents of the slots that did commit (their step ids advanced)."""

    def __init__(self, failures: Sequence[SlotFailure], completed: Mapping[int, np.ndarray]) -> None:
        first = failures[0]
        others = f" (and {len(failures) - 1} more slots)" if len(failures) > 1 else ""
        super().__init__(f"env slot {first.env_id} step {first.step_id}: {first.message}{others}", code=first.code)
        self.env_id = first.env_id
        self.step_id = first.step_id
        self.failures = tuple(failures)
        self.completed = dict(completed)


def slot_actions(actions: Any, count: int) -> list[dict[str, Any]]:
    """One fleet action mapping per slot."""
    if isinstance(actions, Sequence) and actions and all(isinstance(a, Mapping) for a in actions):
        rows: list[dict[str, Any]] = [dict(a) for a in actions]
    else:
        array = np.asarray(actions, dtype=np.float64)
        if array.ndim == 3 and array.shape[1] == 1:
            array = array[:, 0]
        width = JOINT_COUNT + GRIPPER_COUNT
        if array.ndim != 2 or array.shape[1] not in (JOINT_COUNT, width):
            raise ValueError(f"actions must be (B, {JOINT_COUNT}) or (B, {width}); got shape {list(array.shape)}")
        rows = [{"joint_positions": row[:JOINT_COUNT].tolist(),
                 "gripper_position": row[JOINT_COUNT:width].tolist() or None} for row in array]
    if len(rows) != count:
        raise ValueError(f"{len(rows)} actions for {count} env slots")
    return rows


def slot_observations(observations: Any, count: int) -> list[dict[str, Any]]:
    """One fleet observation mapping per slot, from per-slot mappings or one batched mapping."""
    if isinstance(observations, Mapping):
        rows = _split_batched(observations, count)
    elif isinstance(observations, Sequence) and all(isinstance(o, Mapping) for o in observations):
        rows = [dict(o) for o in observations]
    else:
        raise ValueError("observations must be one mapping per slot or one batched mapping")
    if len(rows) != count:
        raise ValueError(f"{len(rows)} observations for {count} env slots")
    return rows


def _split_batched(batch: Mapping[str, Any], count: int) -> list[dict[str, Any]]:
    prompt = batch.get("prompt", "")
    prompts = [prompt] * count if isinstance(prompt, str) else [str(p) for p in prompt]
    images = {str(name): np.asarray(stack) for name, stack in (batch.get("images") or {}).items()}
    state = batch.get("state")
    states = None if state is None else np.asarray(state, dtype=np.float64)
    for name, stack in images.items():
        if stack.ndim != 4 or stack.shape[0] != count:
            raise ValueError(f"batched image {name!r} must be (B={count}, H, W, 3); got {list(stack.shape)}")
    if states is not None and (states.ndim != 2 or states.shape[0] != count):
        raise ValueError(f"batched state must be (B={count}, S); got {list(states.shape)}")
    if len(prompts) != count:
        raise ValueError(f"{len(prompts)} prompts for {count} env slots")
    return [{"prompt": prompts[i], "images": {name: stack[i] for name, stack in images.items()},
             "state": [] if states is None else states[i].tolist(), "extra": dict(batch.get("extra") or {})}
            for i in range(count)]


def stack_latents(latents: Sequence[np.ndarray]) -> np.ndarray:
    if latents and all(latent.ndim >= 1 and latent.shape[0] == 1 for latent in latents):
        return np.concatenate(latents, axis=0)
    return np.stack(latents, axis=0)


class _Slots:
    """env slot -> (session, next step id); builds the batch and takes in its results."""

    def __init__(self) -> None:
        self.sessions: dict[int, Session] = {}
        self.step_ids: dict[int, int] = {}

    def plan(self, env_ids: Sequence[int], actions: Any, observations: Any) -> list[tuple[int, dict[str, Any]]]:
        ids = [int(e) for e in env_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"env_ids has repeated slots: {ids}")
        missing = [e for e in ids if e not in self.sessions]
        if missing:
            raise ValueError(f"generate called for env slots without a session: {missing}")
        acts, obs = slot_actions(actions, len(ids)), slot_observations(observations, len(ids))
        return [(e, {"observation": o, "action": a}) for e, a, o in zip(ids, acts, obs, strict=True)]

    def take(self, env_ids: Sequence[int], results: Sequence[StepResult]) -> np.ndarray:
        completed: dict[int, np.ndarray] = {}
        failures: list[SlotFailure] = []
        for env_id, result in zip((int(e) for e in env_ids), results, strict=True):
            latent = (result.output or {}).get("video_latent") if result.ok else None
            if isinstance(latent, np.ndarray):
                completed[env_id] = latent
                self.step_ids[env_id] = result.step_id + 1
                continue
            code = result.error.code if result.error else ErrorCode.INFERENCE_ERROR
            message = result.error.message if result.error else "the step result has no video_latent"
            failures.append(SlotFailure(env_id, result.step_id, code, message))
        if failures:
            raise SlotStepError(failures, completed)
        return stack_latents([completed[int(e)] for e in env_ids])


class FleetWorldModelBackend:
    """Async backend over a connected :class:`FleetClient`."""

    def __init__(self, fleet: FleetClient, *, model: str = DEFAULT_MODEL, step_timeout: float | None = None,
                 result_window: int = 4) -> None:
        self.fleet, self.model, self.step_timeout, self.result_window = fleet, model, step_timeout, result_window
        self._slots = _Slots()

    def session_id(self, env_id: int) -> str:
        return self._slots.sessions[int(env_id)].session_id

    def step_id(self, env_id: int) -> int:
        """The step id the slot's next ``generate`` sends."""
        return self._slots.step_ids[int(env_id)]

    async def open_session(self, env_ids: Sequence[int]) -> None:
        """Start a trajectory per slot (a slot with a session gets a fresh one)."""
        await self.close_session(env_ids)
        sessions = await asyncio.gather(*(self.fleet.create_session(self.model, MODE, result_window=self.result_window)
                                          for _ in env_ids))
        for env_id, session in zip(env_ids, sessions, strict=True):
            self._slots.sessions[int(env_id)] = session
            self._slots.step_ids[int(env_id)] = 0

    async def generate(self, env_ids: Sequence[int], actions: Any, observations: Any) -> np.ndarray:
        """One step for every slot, submitted together; raises SlotStepError if any failed."""
        plan = self._slots.plan(env_ids, actions, observations)
        tasks = [self._slots.sessions[e].submit(self._slots.step_ids[e], timeout=self.step_timeout, **step)
                 for e, step in plan]
        return self._slots.take(env_ids, await asyncio.gather(*tasks))

    async def close_session(self, env_ids: Sequence[int]) -> None:
        """End these slots' trajectories; slots without a session are ignored."""
        sessions = [self._slots.sessions.pop(int(e), None) for e in env_ids]
        for env_id in env_ids:
            self._slots.step_ids.pop(int(env_id), None)
        await asyncio.gather(*(s.close() for s in sessions if s is not None))

    def offload(self) -> None:
        """No-op: the weights live on the workers."""

    def onload(self) -> None:
        """No-op: the weights live on the workers."""


class SyncFleetWorldModelBackend:
    """The same backend for RLinf's synchronous env workers, over a :class:`SyncFleetClient`.

    It drives a :class:`FleetWorldModelBackend` on the sync client's event loop, so both share
    one implementation; each call blocks until the async one is done and raises what it raises.
    """

    def __init__(self, fleet: SyncFleetClient, *, model: str = DEFAULT_MODEL, step_timeout: float | None = None,
                 result_window: int = 4) -> None:
        self.fleet = fleet
        self.backend = FleetWorldModelBackend(fleet.client, model=model, step_timeout=step_timeout,
                                              result_window=result_window)

    @property
    def model(self) -> str:
        return self.backend.model

    @property
    def step_timeout(self) -> float | None:
        return self.backend.step_timeout

    @property
    def result_window(self) -> int:
        return self.backend.result_window

    def session_id(self, env_id: int) -> str:
        return self.backend.session_id(env_id)

    def step_id(self, env_id: int) -> int:
        """The step id the slot's next ``generate`` sends."""
        return self.backend.step_id(env_id)

    def open_session(self, env_ids: Sequence[int]) -> None:
        self.fleet.call(self.backend.open_session(env_ids))

    def generate(self, env_ids: Sequence[int], actions: Any, observations: Any) -> np.ndarray:
        return self.fleet.call(self.backend.generate(env_ids, actions, observations))

    def close_session(self, env_ids: Sequence[int]) -> None:
        self.fleet.call(self.backend.close_session(env_ids))

    def offload(self) -> None:
        """No-op: the weights live on the workers."""

    def onload(self) -> None:
        """No-op: the weights live on the workers."""
