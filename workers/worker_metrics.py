"""A worker's metrics: what the step path records, the gauges each heartbeat refreshes, and the
``/metrics`` server on ``--metrics-port`` (none when the port is not given; it answers ``/ready``
too, see :meth:`workers.worker.Worker.ready_now`); and the worker's share
of the cell's stats stream (``StepStats``, below), which the dashboard reads.

The executor calls :meth:`committed`, :meth:`duplicate` and :meth:`failed` once per answered step;
the model label is one the engine serves (anything else counts as ``other``), so a client naming
models at random cannot grow the label set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Protocol

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from broker.ops.cell_stats import BUCKETS_MS, StepSummary, bucket_of, publish_summary
from broker.ops.metrics import FleetMetrics, MetricsServer, ReadyCheck, StepHistogramChild, serve_metrics
from broker.redis.keys import CellKeys
from broker.redis.refusals import RedisRefused
from workers.engines.base import Engine
from workers.rate_limit import WarningLimiter
from workers.result_server import HeldResults
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)
OTHER_MODEL = "other"
# steps; queue, engine, commit, total
_Committed = tuple[Counter, StepHistogramChild, StepHistogramChild, StepHistogramChild, StepHistogramChild]


class SessionModel(Protocol):
    """What the sessions gauge reads of a session's state (workers.executor.SessionState)."""

    model: str


class WorkerMetrics:
    def __init__(self, port: int | None, models: Iterable[str] = ()) -> None:
        self.port = port
        self.fleet = FleetMetrics()
        self.models = frozenset(models)
        self._server: MetricsServer | None = None
        self._committed: dict[str, _Committed] = {}
        self._refusal_logs: dict[str, WarningLimiter] = {}  # one per refusal reason

    def start(self, ready: ReadyCheck | None = None) -> None:
        """Serve /metrics (and /ready when ``ready`` is given) on the port, if one was given."""
        if self.port is not None and self._server is None:
            self._server = serve_metrics(self.port, self.fleet.registry, ready=ready)
            log.info("metrics at http://0.0.0.0:%d/metrics", self._server.port)

    @property
    def bound_port(self) -> int | None:
        """The port serving /metrics (differs from ``port`` when that was 0)."""
        return self._server.port if self._server is not None else None

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def held_results(self, settings: WorkerSettings) -> HeldResults:
        """The large results a worker with ``--serve-results`` holds for its trainers, counted in
        ``rollout_fleet_results_direct``, ``rollout_fleet_results_unclaimed`` and
        ``rollout_fleet_results_held_bytes``."""
        served, not_held = self.fleet.results_direct.labels("served"), self.fleet.results_direct.labels("not_held")
        unclaimed = self.fleet.results_unclaimed
        held = HeldResults(hold_s=settings.results_hold_s, max_bytes=settings.results_max_bytes,
                           on_take=lambda ok: (served if ok else not_held).inc(), on_unclaimed=unclaimed.inc)
        self.fleet.results_held_bytes.set_function(lambda: held.bytes)
        return held

    def model(self, model: str) -> str:
        return model if model in self.models else OTHER_MODEL

    # ------------------------------------------------------------------ the step path

    def committed(self, model: str, *, queue_ms: float, engine_ms: float, commit_s: float,
                  enqueued_ms: float) -> None:
        count, queue, engine, commit, total = self._committed_children(model)
        count.inc()
        queue.observe(queue_ms / 1000.0)
        engine.observe(engine_ms / 1000.0)
        commit.observe(commit_s)
        # enqueued_ms is the client's wall clock: a skewed clock must not make a negative latency.
        total.observe(max(0.0, time.time() - enqueued_ms / 1000.0))

    def _committed_children(self, model: str) -> _Committed:
        """The five labelled series a committed step updates, looked up once per model: prometheus
        ``labels()`` hashes and locks on every call, five times per step."""
        label = self.model(model)  # the key too: random model names cannot grow this dict
        children = self._committed.get(label)
        if children is None:
            seconds = self.fleet.step_seconds
            children = self._committed[label] = (
                self.fleet.steps.labels(label, "committed"), seconds.labels(label, "queue"),
                seconds.labels(label, "engine"), seconds.labels(label, "commit"), seconds.labels(label, "total"))
        return children

    def duplicate(self, model: str) -> None:
        self.fleet.steps.labels(self.model(model), "duplicate").inc()

    def failed(self, model: str, code: str, *, dead_letter: bool) -> None:
        self.fleet.steps.labels(self.model(model), code).inc()
        if dead_letter:
            self.fleet.dead_letters.inc()

    def refused(self, refused: RedisRefused) -> None:
        """Redis refused a call (OOM, MISCONF, ...): counted by reason, logged at most once a minute
        per reason (the worker retries each call until Redis writes again)."""
        self.fleet.redis_refusals.labels(refused.reason.value).inc()
        limiter = self._refusal_logs.setdefault(refused.reason.value, WarningLimiter(log, burst=1))
        limiter.warning("redis refuses writes; jobs wait and heartbeats retry until it writes again: %s", refused)

    def rebuilt(self, seconds: float) -> None:
        self.fleet.context_rebuild_seconds.observe(seconds)

    def batch(self, model: str, size: int) -> None:
        self.fleet.batch_size.labels(self.model(model)).observe(size)

    # ------------------------------------------------------------------ gauges (read at each scrape)

    def watch(self, engine: Engine, sessions: Mapping[str, SessionModel], running: Collection[str]) -> None:
        """Gauges computed when Prometheus scrapes (in the server's thread): the worker's own dict
        and set, copied by one C-level call each, so the loop's changes cannot break the read."""
        def owned(model: str) -> Callable[[], float]:
            return lambda: sum(1 for s in list(sessions.values()) if s.model == model)

        def version(model: str) -> Callable[[], float]:  # each model's own (Engine.policy_version_of)
            return lambda: engine.policy_version_of(model)

        for model in self.models:
            self.fleet.sessions.labels(model).set_function(owned(model))
            self.fleet.policy_version.labels(model).set_function(version(model))
        self.fleet.inbox_pending.set_function(lambda: len(running))


# ------------------------------------------------------------------ the cell's stats stream
# A worker's share of the cell's stats stream (see :mod:`broker.ops.cell_stats`).
#
# The executor records each committed step's latency (enqueue to commit) and each failure here;
# the heartbeat loop calls :meth:`StepStats.tick`, which publishes one summary per interval. An
# interval with nothing to say publishes nothing, so an idle fleet adds nothing to the stream.

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
