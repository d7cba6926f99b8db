"""Autoscaling a Ray fleet on its own demand signal: the sessions its live workers own against
their capacity (the fill).

The controller checks every ``interval_s``: ``wanted = ceil(sessions / (target_fill x capacity
of one worker))``, kept within ``[min_workers, max_workers]``. More wanted than running: it adds
them at once (a new placement group; on a Ray cluster with an autoscaler, GPU nodes come with the
bundles). Fewer: only after ``down_after`` checks in a row want fewer (a burst of closes does not
drain a worker that the next burst of creates needs), and then it drains the newest workers, as
``scale`` does. A fleet at ``max_workers`` and full refuses sessions with ``capacity_exhausted``,
as any full cell does.

Why sessions and not queued steps: a session is pinned to its worker for its life, so what a new
worker relieves is the session count of the others (the capacity a create needs); steps queue per
worker inbox, which no single stream's lag describes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from broker.ops.status import REDIS_TIMEOUT_S, cell_status
from broker.redis.aio import resolve
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis


@dataclass(frozen=True)
class Autoscale:
    """The bounds and the target of a fleet's autoscaling."""

    min_workers: int
    max_workers: int
    target_fill: float = 0.7  # sessions / capacity the fleet's live workers aim at
    interval_s: float = 10.0  # between two checks
    down_after: int = 3  # checks in a row that want fewer workers before a scale-down

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"autoscaling needs 0 <= min_workers <= max_workers and max_workers >= 1, got "
                             f"{self.min_workers} and {self.max_workers}")
        if not 0 < self.target_fill <= 1:
            raise ValueError(f"target_fill {self.target_fill:g} must be in (0, 1]")
        if self.interval_s <= 0 or self.down_after < 1:
            raise ValueError("interval_s must be positive and down_after at least 1")

    def wanted(self, sessions: int, capacity_each: int) -> int:
        """How many workers ``sessions`` need at the target fill, within the bounds."""
        need = math.ceil(sessions / (self.target_fill * capacity_each)) if capacity_each > 0 else 0
        return min(max(need, self.min_workers), self.max_workers)


@dataclass(frozen=True)
class FleetLoad:
    sessions: int  # owned by the fleet's live workers
    capacity_each: int  # the largest capacity one of them offers (0: none live)


def fleet_worker_id(fleet: str) -> re.Pattern[str]:
    """The worker ids of one fleet's workers (``ray-NAME-INDEX-HEX``, set by its actors)."""
    return re.compile(rf"ray-{re.escape(fleet)}-\d+-[0-9a-f]{{6}}")


async def fleet_load(cell: CellConfig, fleet: str) -> FleetLoad:
    """The sessions and capacity of ``fleet``'s live workers in ``cell``: the owned-session counts
    and capacities placement itself counts (``keys.owned``, ``keys.capacity``)."""
    report = await cell_status(config=cell)
    ours = fleet_worker_id(fleet)
    live = [w.worker_id for w in report.workers if ours.fullmatch(w.worker_id) and w.live(cell.lease_ms)]
    if not live:
        return FleetLoad(0, 0)
    redis = open_redis(cell.redis_url, socket_timeout=REDIS_TIMEOUT_S)
    try:
        owned = await resolve(redis.hmget(cell.keys.owned, live))
        capacity = await resolve(redis.hmget(cell.keys.capacity, live))
    finally:
        await redis.aclose()
    return FleetLoad(sum(_count(n) for n in owned), max(_count(c) for c in capacity))


def _count(raw: bytes | str | None) -> int:
    try:
        return max(int(raw or 0), 0)
    except ValueError:
        return 0
