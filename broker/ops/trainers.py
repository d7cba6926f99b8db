"""Per-trainer caps on open sessions: read and set them (the ``rollout-fleet trainers`` verb is
:mod:`cli.trainers`).

A cap bounds how many sessions one trainer may hold open in a cell, so that one trainer cannot
take every worker's capacity from the others sharing the fleet. create.lua checks it atomically
against the count it keeps (``CellKeys.trainer_open``); lowering a cap below a trainer's open
sessions closes none of them, it only refuses new ones (``trainer_cap_reached``) until enough close.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.keys import CellKeys
from schemas.sharing import DEFAULT_CAP_FIELD


@dataclass(frozen=True)
class TrainerRow:
    cell: str
    trainer: str  # "*": the default cap of every trainer without its own
    open_sessions: int
    cap: int | None  # the cap that applies (its own, else the default); None: no cap
    own_cap: bool  # the cap is the trainer's own, not the default


def _int(value: Any) -> int:
    return int(value.decode() if isinstance(value, bytes) else value)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


async def list_trainers(redis: Redis, keys: CellKeys, cell: str) -> list[TrainerRow]:
    """Every trainer of the cell with a cap or open sessions, and the default cap (``*``) if set."""
    caps = {_text(k): _int(v) for k, v in (await resolve(redis.hgetall(keys.trainer_caps))).items()}
    opened = {_text(k): _int(v) for k, v in (await resolve(redis.hgetall(keys.trainer_open))).items()}
    default = caps.get(DEFAULT_CAP_FIELD)
    rows = [TrainerRow(cell, DEFAULT_CAP_FIELD, 0, default, True)] if default is not None else []
    for name in sorted((set(caps) | set(opened)) - {DEFAULT_CAP_FIELD}):
        rows.append(TrainerRow(cell, name, opened.get(name, 0), caps.get(name, default), name in caps))
    return rows


async def set_cap(redis: Redis, keys: CellKeys, trainer: str, cap: int | None) -> None:
    """Set (``cap`` an int) or remove (None) one trainer's cap, or the default's (``*``)."""
    if cap is None:
        await resolve(redis.hdel(keys.trainer_caps, trainer))
    else:
        await resolve(redis.hset(keys.trainer_caps, trainer, str(cap)))
