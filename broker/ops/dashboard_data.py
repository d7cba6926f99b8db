"""What the live dashboard shows, read from Redis alone: workers, sessions by state, the stats
window (steps/s, latency percentiles, failovers) and the dead letters, with their replay.

Every read is bounded (sessions sampled, dead letters capped) so that a page refreshing every two
seconds costs the cell the same with ten sessions or a million.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from broker.ops.cell_stats import DEFAULT_WINDOW_S, read_window
from broker.ops.replay import ReplayOutcome, list_dead, replay_ids
from broker.redis.aio import resolve
from broker.redis.connect import server_time_ms
from broker.redis.scripts import Scripts

MAX_SESSIONS_READ = 2000  # sessions classified per refresh; the total is exact, the split a sample
MAX_DEAD_SHOWN = 50
# Pages open in many tabs share one read per second: a 5-minute window of 100 workers is ~12,000
# stream entries (measured ~90-190 ms to read and sum on a busy 2-core machine).
SNAPSHOT_REUSE_S = 1.0
_WORKER_FIELDS = ("state", "engine", "models", "capacity", "load", "policy_version", "weights_error",
                  "committed_steps", "engine_ready")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else "" if value is None else str(value)


class CachedSnapshot:
    """A snapshot reused for SNAPSHOT_REUSE_S: several open dashboards cost Redis one read a second."""

    _last: tuple[float, dict[str, Any]] | None = None  # (monotonic time, snapshot)

    async def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as JSON-ready data (reused for SNAPSHOT_REUSE_S)."""
        if self._last is not None and time.monotonic() - self._last[0] < SNAPSHOT_REUSE_S:
            return self._last[1]
        snapshot = await self._read_snapshot()
        self._last = (time.monotonic(), snapshot)
        return snapshot

    async def _read_snapshot(self) -> dict[str, Any]:
        raise NotImplementedError


class DashboardSource(CachedSnapshot):
    """One cell's dashboard data over a Redis connection someone else owns (the gateway's fleet
    client, or the ``dashboard`` verb's own)."""

    def __init__(self, scripts: Scripts, lease_ms: int, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.scripts, self.lease_ms, self.window_s = scripts, lease_ms, window_s
        self.label = f"cell {scripts.keys.cell}"  # the page's title
        self._last: tuple[float, dict[str, Any]] | None = None  # (monotonic time, snapshot)

    async def _now_ms(self) -> int:
        return await server_time_ms(self.scripts.redis, self.scripts.keys.workers)

    async def workers(self, now_ms: int) -> list[dict[str, Any]]:
        redis, keys = self.scripts.redis, self.scripts.keys
        beats: Any = await redis.zrange(keys.workers, 0, -1, withscores=True)
        pipe = redis.pipeline(transaction=False)
        for wid, _ in beats:
            pipe.hmget(keys.worker(_text(wid)), list(_WORKER_FIELDS))
        rows: Any = await pipe.execute() if beats else []
        out = []
        for (wid, score), values in zip(beats, rows, strict=True):
            fields = {name: _text(v) for name, v in zip(_WORKER_FIELDS, values, strict=True)}
            age = now_ms - int(score)
            # No engine_ready field (a worker from before it existed): its registration says ready.
            ready = fields.pop("engine_ready") not in ("0", "false", "no")
            out.append({"worker_id": _text(wid), "live": age <= self.lease_ms, "heartbeat_age_ms": age,
                        "engine_ready": ready, **fields})
        return out

    async def sessions(self, live_workers: set[str]) -> dict[str, int]:
        """Live sessions by state: ``busy`` (steps queued or running), ``idle``, ``orphaned`` (its
        owner is not live: it fails over once the lease runs out)."""
        redis, keys = self.scripts.redis, self.scripts.keys
        total = int(await resolve(redis.hlen(keys.sessions)))
        sample: list[tuple[str, str]] = []
        async for sid, owner in redis.hscan_iter(keys.sessions, count=500):
            sample.append((_text(sid), _text(owner)))
            if len(sample) >= MAX_SESSIONS_READ:
                break
        pipe = redis.pipeline(transaction=False)
        for sid, _ in sample:
            pipe.hmget(keys.session(sid), ["committed_step_id", "next_step_id"])
        steps: Any = await pipe.execute() if sample else []
        counts = {"total": total, "busy": 0, "idle": 0, "orphaned": 0, "sampled": len(sample)}
        for (_, owner), (committed, next_step) in zip(sample, steps, strict=True):
            if owner not in live_workers:
                counts["orphaned"] += 1
            elif int(_text(next_step) or 0) > int(_text(committed) or -1) + 1:
                counts["busy"] += 1
            else:
                counts["idle"] += 1
        return counts

    async def dead_letters(self) -> dict[str, Any]:
        total = int(await self.scripts.redis.xlen(self.scripts.keys.dead))
        jobs = await list_dead(self.scripts, limit=MAX_DEAD_SHOWN)
        shown = [{"entry_id": j.entry_id, "session_id": j.session_id, "step_id": j.step_id, "code": j.code,
                  "reason": j.reason, "attempts": j.attempts, "failed_ms": j.failed_ms, "model": j.model,
                  "replayable": j.replayable} for j in jobs]
        return {"total": total, "shown": shown}

    async def _read_snapshot(self) -> dict[str, Any]:
        now_ms = await self._now_ms()
        workers = await self.workers(now_ms)
        live = {w["worker_id"] for w in workers if w["live"]}
        window = await read_window(self.scripts.redis, self.scripts.keys, self.window_s)
        return {"now_ms": now_ms, "lease_ms": self.lease_ms, "workers": workers,
                "sessions": await self.sessions(live), "stats": window.as_json(),
                "committed_total": sum(int(w.get("committed_steps") or 0) for w in workers),
                "dead_letters": await self.dead_letters()}

    async def replay(self, entry_id: str) -> dict[str, Any]:
        """Re-enqueue one dead letter, as ``rollout-fleet replay run ENTRY_ID`` does."""
        [outcome] = await replay_ids(self.scripts, [entry_id])
        self._last = None  # the next refresh shows the replay's effect
        return _outcome_json(outcome)


def _outcome_json(outcome: ReplayOutcome) -> dict[str, Any]:
    return dataclasses.asdict(outcome)
