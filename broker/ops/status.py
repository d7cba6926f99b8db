"""A cell's health from Redis alone: workers, their liveness and load, sessions, dead letters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from broker.redis.config import CellConfig
from broker.redis.keys import INBOX_GROUP


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    heartbeat_age_ms: int
    fields: dict[str, str]
    inbox_length: int
    inbox_pending: int


@dataclass(frozen=True)
class CellReport:
    workers: list[WorkerInfo] = field(default_factory=list)
    live_sessions: int = 0
    dead_letters: int = 0


async def cell_status(url: str | None = None, *, prefix: str | None = None, cell: str | None = None,
                      config: CellConfig | None = None) -> CellReport:
    """``url``, ``prefix`` and ``cell`` override ``config``'s (default: ``CellConfig()``)."""
    config = (config or CellConfig()).with_overrides(redis_url=url, prefix=prefix, cell=cell)
    keys = config.keys
    redis = Redis.from_url(config.redis_url, decode_responses=True)
    try:
        now_s, now_us = await redis.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        beats: Any = await redis.zrange(keys.workers, 0, -1, withscores=True)
        infos = []
        for wid, score in beats:
            fields: Any = await redis.hgetall(keys.worker(wid))
            inbox = keys.inbox(wid)
            length = await redis.xlen(inbox)
            pending = 0
            if length:
                summary: Any = await redis.xpending(inbox, INBOX_GROUP)
                pending = int(summary.get("pending", 0)) if isinstance(summary, dict) else 0
            infos.append(WorkerInfo(wid, now_ms - int(score), dict(fields), int(length), pending))
        return CellReport(workers=infos, live_sessions=int(await redis.hlen(keys.sessions)),
                          dead_letters=int(await redis.xlen(keys.dead)))
    finally:
        await redis.aclose()


def format_status(report: CellReport, lease_ms: int | None = None) -> str:
    """A table of the report; a worker is alive while its heartbeat is younger than ``lease_ms``
    (default: the cell's default lease)."""
    lease_ms = CellConfig().lease_ms if lease_ms is None else lease_ms
    lines = [f"{'worker':<40} {'state':<9} {'alive':<6} {'beat_ms':>8} {'load':>5} {'inbox':>6} {'pending':>7} "
             f"{'idle_closed':>11} {'engine_ready':<12}"]
    for w in report.workers:
        alive = "yes" if w.heartbeat_age_ms <= lease_ms else "NO"
        lines.append(f"{w.worker_id:<40} {w.fields.get('state', '?'):<9} {alive:<6} {w.heartbeat_age_ms:>8} "
                     f"{w.fields.get('load', '?'):>5} {w.inbox_length:>6} {w.inbox_pending:>7} "
                     f"{w.fields.get('idle_closed', '0'):>11} {_engine_ready(w.fields):<12}")
    lines.append(f"sessions={report.live_sessions} dead_letters={report.dead_letters} "
                 f"checked_at={time.strftime('%H:%M:%S')}")
    return "\n".join(lines)


def _engine_ready(fields: dict[str, str]) -> str:
    """yes, or NO with the worker's reason (a worker from before readiness checks says nothing: ?)."""
    ready = fields.get("engine_ready")
    if ready is None:
        return "?"
    return "yes" if ready == "1" else f"NO ({fields.get('engine_reason', '')})"
