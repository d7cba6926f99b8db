"""Placement across cells: how much room a cell has for a (mode, model), and the order in which a
client given no cell tries the live cells (most free capacity first).

How a cell counts its capacity is :func:`free_capacity`'s alone; the order and the fallback to the
next cell on ``capacity_exhausted`` are :class:`broker.client.fleet.FleetClient`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from broker.redis.cells import redis_now_ms
from broker.redis.keys import CellKeys


async def free_capacity(redis: Redis, keys: CellKeys, *, mode: str, model: str, lease_ms: int) -> int | None:
    """Sessions of (mode, model) the cell's live workers can still take, judged as ``create.lua``
    judges a worker (``share_with_room`` in prelude.lua): its capacity counts sessions over all its
    pools (``owned``), and a per-model split caps this pool's share. Summed over the pool's workers
    whose heartbeat is within the lease. None when no worker of the cell serves (mode, model)."""
    pool = keys.pool(mode, model)
    members: Any = await redis.zrange(pool, 0, -1, withscores=True)
    if not members:
        return None
    ids = [wid for wid, _ in members]
    splits = [CellKeys.capacity_split_field(wid.decode(), pool) for wid in ids]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zmscore(keys.workers, ids)
        pipe.hmget(keys.capacity, ids)
        pipe.hmget(keys.owned, ids)
        pipe.hmget(keys.capacity, splits)
        beats, capacities, owned, caps = await pipe.execute()
    now = await redis_now_ms(redis)
    free = 0
    for (_, load), beat, capacity, worker_owned, split in zip(members, beats, capacities, owned, caps, strict=True):
        if beat is None or now - beat > lease_ms:
            continue
        room = int(capacity or 0) - int(worker_owned or 0)
        if split is not None:
            room = min(room, int(split) - int(load))
        free += max(0, room)
    return free


async def placement_order(redis: Redis, prefix: str, cells: list[str], *, mode: str, model: str,
                          lease_ms: int) -> list[str]:
    """``cells`` that serve (mode, model), the most free capacity first (ties by name). Cells with
    none free stay in the list, last: counts move, and their create script has the last word."""
    # The cells are asked at once (a round trip for all, not one per cell: bench/cells.py).
    frees = await asyncio.gather(*(free_capacity(redis, CellKeys(prefix, cell), mode=mode, model=model,
                                                 lease_ms=lease_ms) for cell in cells))
    room = [(-free, cell) for cell, free in zip(cells, frees, strict=True) if free is not None]
    return [cell for _, cell in sorted(room)]
