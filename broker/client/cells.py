"""Placement across cells: how much room a cell has for a (mode, model), and the order in which a
client given no cell tries the live cells (most free capacity first).

How a cell counts its capacity is :func:`free_capacity`'s alone; the order and the fallback to the
next cell on ``capacity_exhausted`` are :class:`broker.client.fleet.FleetClient`'s.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from broker.redis.cells import redis_now_ms
from broker.redis.keys import CellKeys
from broker.redis.pool_members import pool_members


async def free_capacity(redis: Redis, keys: CellKeys, *, mode: str, model: str, lease_ms: int) -> int | None:
    """Sessions of (mode, model) the cell's live workers can still take, judged as ``create.lua``
    judges a worker (``share_if_room`` in prelude.lua): its capacity counts sessions over all its
    pools (``owned``), and a per-model split caps this pool's share. Summed over the pool's workers
    whose heartbeat is within the lease. None when no worker of the cell serves (mode, model)."""
    members = await pool_members(redis, keys, mode=mode, model=model)
    if not members:
        return None
    now = await redis_now_ms(redis)
    return sum(member.room() for member in members if member.live(now, lease_ms))


async def placement_order(redis: Redis, prefix: str, cells: list[str], *, mode: str, model: str,
                          lease_ms: int) -> list[str]:
    """``cells`` that serve (mode, model), the most free capacity first (ties by name). Cells with
    none free stay in the list, last: counts move, and their create script has the last word."""
    # The cells are asked at once (a round trip for all, not one per cell: bench/cells.py).
    frees = await asyncio.gather(*(free_capacity(redis, CellKeys(prefix, cell), mode=mode, model=model,
                                                 lease_ms=lease_ms) for cell in cells))
    room = [(-free, cell) for cell, free in zip(cells, frees, strict=True) if free is not None]
    return [cell for _, cell in sorted(room)]
