"""A placement pool's members with what placement judges each by, read in two round trips.

``create.lua`` judges the members of a pool (mode, model) inside Redis; the client's cell choice
(``broker.client.cells.free_capacity``) and failover's choice of a new owner
(``broker.ops.failover.placement_candidates``) judge them the same way from here: the pool with its
scores (each member's sessions of this pool), then every member's heartbeat, capacity, per-pool cap,
owned count and engine pressure in one pipeline. A read per member would cost a failover of one
session four round trips per worker of the pool: seconds in a cell of a thousand workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.keys import CellKeys


@dataclass(frozen=True)
class PoolMember:
    worker_id: str
    load: float  # its sessions of this pool (the pool's score)
    heartbeat_ms: float | None  # its last heartbeat by the Redis clock; None when it is not registered
    capacity: int  # sessions over all its pools
    owned: int  # its sessions over all its pools now
    split: float | None  # the pool's own cap on its share (the engine splits its capacity by model)
    pressure: float  # the engine load signal of its last heartbeat, 0..1

    def live(self, now_ms: int, lease_ms: int) -> bool:
        return self.heartbeat_ms is not None and now_ms - self.heartbeat_ms <= lease_ms

    def has_room(self) -> bool:
        """Room for one more session of this pool, as prelude.lua ``share_if_room`` judges it."""
        return self.owned < self.capacity and (self.split is None or self.load < self.split)

    def room(self) -> int:
        """How many more sessions of this pool it can take."""
        free = self.capacity - self.owned
        if self.split is not None:
            free = min(free, int(self.split - self.load))
        return max(0, free)


def _number(raw: Any, default: float = 0.0) -> float:
    try:
        return default if raw is None else float(raw)
    except ValueError:
        return default


async def pool_members(redis: Redis, keys: CellKeys, *, mode: str, model: str) -> list[PoolMember]:
    """Every member of the pool (mode, model), in the pool's order (least loaded first, then by id)."""
    pool = keys.pool(mode, model)
    members: Any = await redis.zrange(pool, 0, -1, withscores=True)
    if not members:
        return []
    ids = [wid for wid, _ in members]
    splits = [CellKeys.capacity_split_field(wid.decode(), pool) for wid in ids]
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zmscore(keys.workers, ids)
        pipe.hmget(keys.capacity, ids)
        pipe.hmget(keys.owned, ids)
        pipe.hmget(keys.capacity, splits)
        pipe.hmget(keys.pressure, ids)
        beats, capacities, owned, caps, pressures = await pipe.execute()
    return [PoolMember(worker_id=wid.decode(), load=float(load), heartbeat_ms=beat,
                       capacity=int(_number(capacity)), owned=int(_number(worker_owned)),
                       split=None if split is None else _number(split), pressure=_number(pressure))
            for (wid, load), beat, capacity, worker_owned, split, pressure
            in zip(members, beats, capacities, owned, caps, pressures, strict=True)]
