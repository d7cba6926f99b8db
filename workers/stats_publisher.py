"""A worker's share of the cell's stats stream (see :mod:`broker.ops.cell_stats`).

The executor records each committed step's latency (enqueue to commit) and each failure here;
the heartbeat loop calls :meth:`StepStats.tick`, which publishes one summary per interval. An
interval with nothing to say publishes nothing, so an idle fleet adds nothing to the stream.
"""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker.ops.cell_stats import BUCKETS_MS, StepSummary, bucket_of, publish_summary
from broker.redis.keys import CellKeys
from workers.rate_limit import WarningLimiter

log = logging.getLogger(__name__)

MAX_INTERVAL_S = 5.0  # at most this long between summaries: the dashboard's "now" lags by this much
HEARTBEATS_PER_SUMMARY = 5  # a fast test heartbeat (100 ms) publishes every 0.5 s


class StepStats:
    """Counters and a latency histogram since the last published summary."""

    def __init__(self, heartbeat_ms: int) -> None:
        self.interval_s = min(MAX_INTERVAL_S, HEARTBEATS_PER_SUMMARY * heartbeat_ms / 1000.0)
        self._histogram = [0] * len(BUCKETS_MS)
        self._committed = 0
        self._failed = 0
        self._since = time.monotonic()
        self._warnings = WarningLimiter(log)  # a Redis outage would warn once per heartbeat otherwise

    def committed(self, latency_ms: float) -> None:
        self._committed += 1
        self._histogram[bucket_of(latency_ms)] += 1

    def failed(self) -> None:
        self._failed += 1

    def _take(self, worker_id: str, now: float) -> StepSummary:
        summary = StepSummary(worker_id, self._committed, self._failed, tuple(self._histogram),
                              int((now - self._since) * 1000))
        self._histogram = [0] * len(BUCKETS_MS)
        self._committed = self._failed = 0
        self._since = now
        return summary

    async def tick(self, redis: Redis, keys: CellKeys, worker_id: str) -> None:
        """Publish a summary when the interval is over and there is something to say. Never
        raises a Redis error: stats must not stop the heartbeat that keeps the worker alive."""
        now = time.monotonic()
        if now - self._since < self.interval_s:
            return
        if not (self._committed or self._failed):
            self._since = now
            return
        summary = self._take(worker_id, now)
        try:
            await publish_summary(redis, keys, summary)
        except (RedisError, OSError) as exc:
            # This interval's counts are lost; the dashboard's rates dip for one interval.
            self._warnings.warning("stats summary not published: %s", exc)
