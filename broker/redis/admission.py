"""AReaL-style admission: a producer bounds the trajectories it starts per policy version.

A producer names its bound (``Admission``) and every session it creates with it is counted in
the cell (``rf:{c}:admission:<name>``, one count per model) by create.lua, in the same script as
the create, so several producer processes share one bound. The bound at announced version ``v``
(``rf:{c}:announced``) is ``(v + max_offpolicyness + 1) * batch_size`` sessions in total: AReaL's
``max_head_offpolicyness`` and ``consumer_batch_size`` (docs/async_rl.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.keys import MAX_NAME_LENGTH, CellKeys, key_part_problem
from schemas.errors import InvalidRequestError

MAX_BATCH_SIZE = 1_000_000
MAX_OFFPOLICYNESS = 1_000_000
MAX_ADMISSION_WAIT_S = 86_400.0


def _count(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"admission {name} must be an int in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class Admission:
    """One producer's admission bound. ``name`` names the shared count (producers that pass the
    same name share it); ``batch_size``: the trainer's batch (trajectories per policy version);
    ``max_offpolicyness``: how many versions ahead of the announced one the producer may start
    trajectories for. ``wait_s``: how long ``create_session`` waits for a later version when the
    bound is reached (0: refuse at once with ``admission_closed``). Bad values raise
    InvalidRequestError here, before anything is sent."""

    name: str
    batch_size: int
    max_offpolicyness: int = 0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        problem = key_part_problem(self.name, max_length=MAX_NAME_LENGTH) if isinstance(self.name, str) else "a string"
        if problem is not None:
            raise InvalidRequestError(f"invalid admission name {self.name!r}: {problem}")
        _count("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        _count("max_offpolicyness", self.max_offpolicyness, 0, MAX_OFFPOLICYNESS)
        wait = self.wait_s
        if (isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait)
                or not 0 <= wait <= MAX_ADMISSION_WAIT_S):
            raise InvalidRequestError(f"admission wait_s must be seconds in [0, {MAX_ADMISSION_WAIT_S:.0f}], "
                                      f"got {wait!r}")

    def bound(self, version: int) -> int:
        """Trajectories admitted in total at announced ``version`` (create.lua computes the same)."""
        return (version + self.max_offpolicyness + 1) * self.batch_size


@dataclass(frozen=True)
class AdmissionState:
    admitted: int  # trajectories admitted so far for the model under this name
    version: int  # the model's announced version (0: none announced yet)
    bound: int  # how many may be admitted at that version

    @property
    def open(self) -> bool:
        return self.admitted < self.bound


async def announced_version(redis: Redis, keys: CellKeys, model: str) -> int:
    """The highest policy version announced for ``model`` in the cell (0: none yet)."""
    raw: Any = await resolve(redis.hget(keys.announced, model))
    return int(raw or 0)


async def admission_state(redis: Redis, keys: CellKeys, admission: Admission, model: str) -> AdmissionState:
    """Where a producer's bound stands for ``model`` (a read: create.lua has the last word)."""
    raw: Any = await resolve(redis.hget(keys.admission(admission.name), model))
    version = await announced_version(redis, keys, model)
    return AdmissionState(int(raw or 0), version, admission.bound(version))
