"""The cell's stats stream (``CellKeys.stats``): what the dashboard shows as rates, latency
percentiles and failovers, from Redis alone.

Every worker appends one small summary per interval (steps committed and failed since the last
one, a latency histogram of the committed steps); the reaper appends one entry per failover. The
stream is capped (``XADD MAXLEN ~``), so it holds the last minutes of a busy cell and never grows.
Any number of dashboards and gateways read the same window; Prometheus is not needed.

Latencies travel as fixed-bucket histograms rather than per-worker percentiles: histograms add
up across workers and intervals, percentiles do not.

Steps/s is each worker's committed steps of the last minute over the time its summaries cover,
added up over the workers (:class:`WorkerRate`): a summary covers the ``interval_ms`` before its
entry id, and the interval still running when the window is read (at most one) is not in the
stream yet. Divided by a fixed minute instead, a fleet stepping for ten seconds showed a sixth of
its rate (7 steps/s while a trainer ran 65).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from broker.redis.connect import server_time_ms
from broker.redis.keys import CellKeys
from broker.redis.layouts import Fields, LayoutError, integer, text

# Upper bounds (ms) of the latency buckets; the last bucket holds everything above 60 s.
BUCKETS_MS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000,
                                 math.inf)
# ~ trimming keeps about this many entries: 100 workers at one summary per 5 s fill it in 10 min.
STATS_MAXLEN = 12_000
DEFAULT_WINDOW_S = 300.0
RATE_WINDOW_S = 60.0  # steps/s is over the last minute: "now", not diluted by the whole window
MAX_READ = 50_000  # the most entries one window read takes (bounded even with an untrimmed stream)


def bucket_of(ms: float) -> int:
    """The index of the bucket that holds a latency of ``ms``."""
    for index, bound in enumerate(BUCKETS_MS):
        if ms <= bound:
            return index
    return len(BUCKETS_MS) - 1  # NaN lands in the last bucket rather than nowhere


def percentile(counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a bucket histogram, interpolated inside its bucket; None when
    empty. The open last bucket answers its lower bound (at least 60 s)."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count and seen + count >= rank:
            low = BUCKETS_MS[index - 1] if index else 0.0
            high = BUCKETS_MS[index]
            if math.isinf(high):
                return low
            return low + (high - low) * max(0.0, rank - seen) / count
        seen += count
    return BUCKETS_MS[-2]


@dataclass(frozen=True)
class StepSummary:
    """One worker's interval: steps committed and failed, and the committed steps' latencies."""

    worker_id: str
    committed: int
    failed: int
    histogram: tuple[int, ...]  # counts per BUCKETS_MS entry
    interval_ms: int

    def fields(self) -> dict[str, str]:
        return {"kind": "steps", "worker": self.worker_id, "committed": str(self.committed),
                "failed": str(self.failed), "hist": ",".join(map(str, self.histogram)),
                "interval_ms": str(self.interval_ms)}


async def publish_summary(redis: Redis, keys: CellKeys, summary: StepSummary) -> None:
    await redis.xadd(keys.stats, summary.fields(), maxlen=STATS_MAXLEN, approximate=True)  # type: ignore[arg-type]


async def record_failover(redis: Redis, keys: CellKeys, worker_id: str, *, moved: int, jobs: int,
                          reason: str) -> None:
    """One failover (a dead worker's sessions moved, or the worker retired) in the stats stream."""
    fields = {"kind": "failover", "worker": worker_id, "moved": str(moved), "jobs": str(jobs), "reason": reason}
    await redis.xadd(keys.stats, fields, maxlen=STATS_MAXLEN, approximate=True)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Failover:
    at_ms: int
    worker_id: str
    moved: int
    jobs: int
    reason: str


@dataclass
class WorkerRate:
    """One worker's summaries of the rate window: steps committed over the span they cover."""

    committed: int = 0
    first_ms: int = 0  # where the oldest summary's interval starts
    newest_ms: int = 0  # the newest summary's entry time
    longest_interval_ms: int = 0

    def add(self, at_ms: int, interval_ms: int, committed: int) -> None:
        start = at_ms - max(0, interval_ms)
        self.first_ms = start if not self.newest_ms else min(self.first_ms, start)
        self.newest_ms = max(self.newest_ms, at_ms)
        self.longest_interval_ms = max(self.longest_interval_ms, interval_ms)
        self.committed += committed

    def steps_per_s(self, now_ms: int) -> float:
        """Its steps over the span covered: up to its newest summary, or up to ``now`` less one
        interval (the one being counted) when it has published nothing since (idle or gone)."""
        end = max(self.newest_ms, now_ms - self.longest_interval_ms)
        return self.committed * 1000.0 / max(1, end - self.first_ms)


@dataclass
class StatsWindow:
    """What the stats stream says about the last ``window_s`` seconds of the cell."""

    window_s: float
    committed: int = 0
    failed: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_MS))
    failovers: list[Failover] = field(default_factory=list)
    reporting_workers: int = 0
    recent_committed: int = 0  # committed in the last RATE_WINDOW_S (or the window, if shorter)
    recent_rates: list[float] = field(default_factory=list)  # each worker's steps/s over that span

    @property
    def steps_per_s(self) -> float:
        return sum(self.recent_rates)

    def as_json(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "committed": self.committed, "failed": self.failed,
                "steps_per_s": round(self.steps_per_s, 3), "reporting_workers": self.reporting_workers,
                "p50_ms": _rounded(percentile(self.histogram, 0.50)),
                "p99_ms": _rounded(percentile(self.histogram, 0.99)),
                "failovers": [f.__dict__ for f in self.failovers]}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _text(fields: Fields, name: str) -> str:
    try:
        return text(fields, name, "")
    except LayoutError:  # not UTF-8: a damaged or hand-written entry never stops the read
        return ""


def _integer(fields: Fields, name: str) -> int:
    try:
        return integer(fields, name, 0)
    except LayoutError:
        return 0


def _add_entry(window: StatsWindow, entry_id: str, fields: Fields, workers: dict[str, WorkerRate],
               recent_from_ms: int) -> None:
    kind = _text(fields, "kind")
    if kind == "steps":
        worker = _text(fields, "worker")
        rate = workers.setdefault(worker, WorkerRate())
        window.committed += _integer(fields, "committed")
        at_ms = int(entry_id.split("-")[0])
        if at_ms >= recent_from_ms:
            window.recent_committed += _integer(fields, "committed")
            rate.add(at_ms, _integer(fields, "interval_ms"), _integer(fields, "committed"))
        window.failed += _integer(fields, "failed")
        for index, count in enumerate(_text(fields, "hist").split(",")[:len(BUCKETS_MS)]):
            window.histogram[index] += int(count) if count.isdigit() else 0
    elif kind == "failover":
        window.failovers.append(Failover(int(entry_id.split("-")[0]), _text(fields, "worker"),
                                         _integer(fields, "moved"), _integer(fields, "jobs"), _text(fields, "reason")))


def summarize(entries: Iterable[tuple[Any, Fields]], window_s: float, now_ms: int) -> StatsWindow:
    window = StatsWindow(window_s)
    workers: dict[str, WorkerRate] = {}
    recent_from_ms = now_ms - int(min(window_s, RATE_WINDOW_S) * 1000)
    for raw_id, fields in entries:
        entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        _add_entry(window, entry_id, fields, workers, recent_from_ms)
    window.reporting_workers = len(workers)
    window.recent_rates = [rate.steps_per_s(now_ms) for rate in workers.values() if rate.newest_ms]
    return window


async def read_window(redis: Redis, keys: CellKeys, window_s: float = DEFAULT_WINDOW_S) -> StatsWindow:
    """The last ``window_s`` seconds of the stream (entry ids are the Redis clock's milliseconds)."""
    now_ms = await server_time_ms(redis, keys.stats)
    start = max(0, now_ms - int(window_s * 1000))
    entries: Any = await redis.xrange(keys.stats, min=f"{start}-0", max="+", count=MAX_READ)
    return summarize(entries, window_s, now_ms)
