"""Waiting for admission, a producer's side of it (the bound itself: broker/redis/admission.py;
docs/async_rl.md): a create that create.lua refuses with ``admission_closed`` waits, at most
``Admission.wait_s``, for a later policy version to be announced for the model, then tries again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis

from broker.redis.admission import Admission, AdmissionState, admission_state, announced_version
from broker.redis.keys import CellKeys
from schemas.errors import AdmissionClosedError

__all__ = ["Admission", "AdmissionState", "admission_state", "admitted"]

T = TypeVar("T")
POLL_S = 0.1  # how often a waiting create reads the announced version (one HGET)


async def admitted(redis: Redis, keys: CellKeys, admission: Admission, model: str,
                   create: Callable[[], Awaitable[T]]) -> T:
    """``create()`` under ``admission``: refused, wait for a version above the one read before
    the attempt, then again; AdmissionClosedError once ``wait_s`` is spent (at once for 0)."""
    deadline = time.monotonic() + admission.wait_s
    while True:
        before = await announced_version(redis, keys, model)
        try:
            return await create()
        except AdmissionClosedError as exc:
            if not await _newer_version(redis, keys, model, before, deadline):
                if admission.wait_s:
                    raise AdmissionClosedError(f"{exc.message} (waited {admission.wait_s:g}s)") from exc
                raise


async def _newer_version(redis: Redis, keys: CellKeys, model: str, seen: int, deadline: float) -> bool:
    """Wait until a version above ``seen`` is announced for ``model``; False at the deadline."""
    while await announced_version(redis, keys, model) <= seen:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(POLL_S, left))
    return True
