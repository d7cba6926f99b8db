"""The dashboard of every cell (a gateway or ``dashboard`` verb given ``--cell '*'``): each known
cell read as :class:`broker.ops.dashboard_data.DashboardSource` reads one, the parts added up.

Counts and latency histograms add up across cells (so the percentiles are the fleet's, not an
average of the cells'); workers and dead letters are listed with their cell. A replay finds the
dead letter's cell by its entry id.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from broker.ops.cell_stats import DEFAULT_WINDOW_S, StatsWindow, read_window
from broker.ops.dashboard_data import MAX_DEAD_SHOWN, CachedSnapshot, DashboardSource
from broker.ops.replay import show
from broker.redis.cells import cells_of, redis_now_ms
from broker.redis.config import CellConfig
from broker.redis.keys import CellKeys
from broker.redis.scripts import Scripts


def _merge_windows(windows: list[StatsWindow], window_s: float) -> StatsWindow:
    total = StatsWindow(window_s)
    for w in windows:
        total.committed += w.committed
        total.failed += w.failed
        total.recent_committed += w.recent_committed
        total.recent_rates += w.recent_rates  # each worker's rate, as one cell's window adds them
        total.reporting_workers += w.reporting_workers
        total.histogram = [a + b for a, b in zip(total.histogram, w.histogram, strict=True)]
        total.failovers += w.failovers
    total.failovers.sort(key=lambda f: f.at_ms)
    return total


class FleetDashboardSource(CachedSnapshot):
    """Dashboard data of every known cell added up, over a Redis connection someone else owns."""

    label = "every cell"

    def __init__(self, redis: Redis, config: CellConfig, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.redis, self.config, self.window_s = redis, config, window_s
        self._cells: dict[str, DashboardSource] = {}
        self._last: tuple[float, dict[str, Any]] | None = None

    def _cell(self, cell: str) -> DashboardSource:
        if cell not in self._cells:
            scripts = Scripts(self.redis, CellKeys(self.config.prefix, cell))
            self._cells[cell] = DashboardSource(scripts, self.config.lease_ms, self.window_s)
        return self._cells[cell]

    async def _read_snapshot(self) -> dict[str, Any]:
        now_ms = await redis_now_ms(self.redis)
        workers: list[dict[str, Any]] = []
        sessions: dict[str, int] = {}
        windows: list[StatsWindow] = []
        dead: dict[str, Any] = {"total": 0, "shown": []}
        for cell in await cells_of(self.redis, self.config):
            source = self._cell(cell)
            mine = [{**w, "cell": cell} for w in await source.workers(now_ms)]
            workers += mine
            for name, count in (await source.sessions({w["worker_id"] for w in mine if w["live"]})).items():
                sessions[name] = sessions.get(name, 0) + count
            windows.append(await read_window(self.redis, source.scripts.keys, self.window_s))
            letters = await source.dead_letters()
            dead["total"] += letters["total"]
            dead["shown"] += [{**j, "cell": cell} for j in letters["shown"]]
        dead["shown"] = sorted(dead["shown"], key=lambda j: j["failed_ms"] or 0)[-MAX_DEAD_SHOWN:]
        return {"now_ms": now_ms, "lease_ms": self.config.lease_ms, "workers": workers, "sessions": sessions,
                "stats": _merge_windows(windows, self.window_s).as_json(),
                "committed_total": sum(int(w.get("committed_steps") or 0) for w in workers), "dead_letters": dead}

    async def replay(self, entry_id: str) -> dict[str, Any]:
        """Re-enqueue one dead letter of whichever cell holds ``entry_id``."""
        cells = await cells_of(self.redis, self.config)
        holder = cells[0] if cells else None
        for cell in cells:
            if await show(self._cell(cell).scripts, entry_id) is not None:
                holder = cell
                break
        if holder is None:
            return {"entry_id": entry_id, "session_id": "", "step_id": None, "status": "not_found",
                    "message": "no cell has registered a worker"}
        self._last = None  # the next refresh shows the replay's effect
        return await self._cell(holder).replay(entry_id)
