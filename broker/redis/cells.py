"""The deployment's cell registry: which cells exist and which have live workers.

Every worker's registration and heartbeat (:class:`broker.redis.scripts.Scripts`) also raises
its cell's score in the ZSET ``<prefix>:cells`` to the heartbeat's time (Redis clock, ``ZADD
GT``). The key belongs to no cell and is touched only by single-key commands, never inside a
cell's script, so on a Redis Cluster it may sit in any slot.

- live cells (placement of new sessions): a heartbeat within the lease;
- known cells (status, sessions, replays, the supervisor's passes): a heartbeat within
  :data:`CELL_FORGET_MS`; a cell whose workers all stopped a while ago still has sessions,
  dead letters and expired leases to look after. Older entries are removed when read.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from broker.redis.config import CellConfig
from broker.redis.keys import DEFAULT_CELL, CellKeys, DeploymentKeys, cell_named_by, check_session_id
from schemas.errors import InvalidRequestError

CELL_FORGET_MS = 86_400_000  # a cell with no heartbeat for a day leaves the registry


async def touch_cell(redis: Redis, keys: CellKeys, now_ms: int) -> None:
    """Record a heartbeat of ``keys.cell`` at ``now_ms`` (never moves its score back)."""
    await redis.zadd(DeploymentKeys(keys.prefix).cells, {keys.cell: now_ms}, gt=True)


async def redis_now_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _cells_since(redis: Redis, prefix: str, age_ms: int) -> list[str]:
    raw: Any = await redis.zrangebyscore(DeploymentKeys(prefix).cells, (await redis_now_ms(redis)) - age_ms, "+inf")
    return sorted(c.decode() if isinstance(c, bytes) else str(c) for c in raw)


async def live_cells(redis: Redis, prefix: str, *, lease_ms: int) -> list[str]:
    """Cells with a worker heartbeat within ``lease_ms``, by name."""
    return await _cells_since(redis, prefix, lease_ms)


async def known_cells(redis: Redis, prefix: str) -> list[str]:
    """Cells with a worker heartbeat within :data:`CELL_FORGET_MS`, by name; older ones are
    forgotten on the way."""
    key = DeploymentKeys(prefix).cells
    await redis.zremrangebyscore(key, "-inf", f"({(await redis_now_ms(redis)) - CELL_FORGET_MS}")
    return await _cells_since(redis, prefix, CELL_FORGET_MS)


async def cells_of(redis: Redis, config: CellConfig) -> list[str]:
    """The cells an ops command of ``config`` covers: its one cell, or with cell ``*`` every known
    cell."""
    return await known_cells(redis, config.prefix) if config.any_cell else [config.cell]


def routed_cell(config: CellConfig, session_id: str) -> str:
    """The cell an ops command of ``config`` finds ``session_id`` in: the one the id names (for a
    command of every cell; ids naming none are in the default cell), else the command's own."""
    named = cell_named_by(check_session_id(session_id))
    if config.any_cell:
        return DEFAULT_CELL if named is None else named
    if named is not None and named != config.cell:
        raise InvalidRequestError(f"session {session_id!r} is in cell {named!r}, not in cell {config.cell!r} "
                                  "(--cell '*' finds it by its id)")
    return config.cell
