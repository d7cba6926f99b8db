"""``GET /health``: 200 when Redis answers and a live worker serves the gateway's default model,
else 503 with the reason. Answered without an API key and bounded in time (load balancers probe it)."""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from broker.client import FleetClient
from broker.redis.aio import resolve
from broker.redis.connect import server_time_ms
from broker.redis.keys import CellKeys
from schemas.messages import Mode

HEALTH_TIMEOUT_S = 2.0


async def health_problem(fleet: FleetClient, model: str) -> tuple[str | None, int]:
    """(why the gateway cannot serve, or None; how many live workers serve ``model``, in the
    gateway's cell or, for a gateway of every cell, in every live cell)."""
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            live = 0
            for cell in await fleet.live_cells():
                keys = CellKeys(fleet.config.prefix, cell)
                pool = keys.pool(Mode.WORLD_MODEL_ENV.value, model)
                now_ms = await server_time_ms(fleet.redis, keys.workers)  # the clock of the cell's master
                members: list[str] = [m.decode() for m in await resolve(fleet.redis.zrange(pool, 0, -1))]
                beats = await resolve(fleet.redis.zmscore(keys.workers, members)) if members else []
                live += sum(1 for beat in beats if beat is not None and now_ms - beat <= fleet.lease_ms)
    except (RedisError, OSError, TimeoutError) as exc:
        # The reason goes to unauthenticated probes: the error type only, not the address in the message.
        return f"redis does not answer ({type(exc).__name__})", 0
    if not live:
        return f"no live worker serves model {model!r}", 0
    return None, live
