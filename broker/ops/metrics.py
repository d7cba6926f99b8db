"""The fleet's Prometheus metrics, defined once: names, labels and buckets.

Workers, the gateway and the supervisor each own one :class:`FleetMetrics` (its own
``CollectorRegistry``, so two workers in one test process never share a counter) and expose it
with :func:`serve_metrics` or, in the gateway, a ``/metrics`` route; a worker's server also answers
``/ready`` (:data:`ReadyCheck`: 200 or 503 with a one-line reason), its Kubernetes readiness probe.
Labels are bounded: a model
name, an outcome (``committed``, ``duplicate`` or an error code) and a phase, never a session or a
worker id, so a fleet with a million sessions still has a few dozen series.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# Seconds: a step runs in about a millisecond on the reference engine and seconds on a big model.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REBUILD_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 120.0)
PHASES = ("queue", "engine", "commit", "total")
ENV_PORT = "ROLLOUT_FLEET_METRICS_PORT"
READY_PATH = "/ready"
# Whether the process can do its work now, and why not: (True, "ready") or (False, "one line").
ReadyCheck = Callable[[], tuple[bool, str]]
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class FleetMetrics:
    """Every metric of the fleet on one registry; a process fills the ones its role knows."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.steps = Counter("rollout_fleet_steps", "Steps answered, by outcome: committed, duplicate, "
                             "or the error code of a failure", ["model", "outcome"], registry=r)
        self.step_seconds = StepHistogram("rollout_fleet_step_seconds", "Step latency by phase: queue "
                                          "(enqueued to picked), engine, commit, total (enqueued to committed)",
                                          ("model", "phase"), STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("rollout_fleet_batch_size", "Requests per engine batch", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.sessions = Gauge("rollout_fleet_sessions", "Sessions owned (worker) or open (supervisor), "
                              "by model", ["model"], registry=r)
        self.inbox_pending = Gauge("rollout_fleet_inbox_pending", "Inbox entries read and not yet "
                                   "acknowledged", registry=r)
        self.failovers = Counter("rollout_fleet_failovers", "Sessions moved off a dead worker by this "
                                 "process's reaping passes", registry=r)
        self.rebalanced = Counter("rollout_fleet_rebalanced", "Sessions this worker moved to less loaded "
                                  "workers at a step boundary (workers/rebalance.py)", registry=r)
        self.drain_stuck = Gauge("rollout_fleet_drain_stuck_sessions", "Sessions a draining worker could not "
                                 "hand over (no live worker with free capacity) and keeps serving", registry=r)
        self.context_rebuild_seconds = Histogram("rollout_fleet_context_rebuild_seconds", "Time to rebuild "
                                                 "a session's context on a new owner",
                                                 buckets=REBUILD_BUCKETS, registry=r)
        self.dead_letters = Counter("rollout_fleet_dead_letters", "Jobs dead-lettered (worker: by this "
                                    "worker; supervisor: growth of the cell's dead-letter stream)", registry=r)
        self.policy_version = Gauge("rollout_fleet_policy_version", "Weight version serving each model",
                                    ["model"], registry=r)
        self.redis_refusals = Counter("rollout_fleet_redis_refusals", "Redis calls refused because Redis "
                                      "would not write (reason: oom, misconf, readonly, noreplicas, busy; "
                                      "broker/redis/refusals.py)", ["reason"], registry=r)
        self.results_direct = Counter("rollout_fleet_results_direct", "Large results trainers asked this "
                                      "worker for (--serve-results), by outcome: served, or not_held (the "
                                      "trainer read Redis instead)", ["outcome"], registry=r)
        self.results_unclaimed = Counter("rollout_fleet_results_unclaimed", "Committed large results this "
                                         "worker held that no trainer took within --results-hold (or that "
                                         "--results-max-bytes pushed out): their trainers read Redis",
                                         registry=r)
        self.results_held_bytes = Gauge("rollout_fleet_results_held_bytes", "Bytes of committed large results "
                                        "this worker holds for their trainers", registry=r)
        self.engine_ready = Gauge("rollout_fleet_engine_ready", "1 when the engine answers its readiness "
                                  "check, 0 when it does not (the worker then takes no new sessions)",
                                  registry=r)

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type, for a handler that serves ``/metrics`` itself."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class StepHistogramChild:
    """One series of a :class:`StepHistogram`: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """prometheus-client's ``Histogram.observe``: a value on a bound counts in that bucket, a NaN in
        none (it only reaches the sum)."""
        if amount == amount:
            self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class StepHistogram:
    """A labelled histogram for the step path, exposed exactly as prometheus-client's ``Histogram``
    (``_bucket``, ``_count``, ``_sum``, ``_created``): an observation is one bisect and two adds.

    prometheus-client's ``observe`` takes a lock per bucket and per sum and walks the buckets in
    Python; a worker makes four per committed step, 6% of its instructions per tiny step
    (docs/benchmarks.md, "Instructions per step"). Observations come from one thread (the event
    loop's); a scrape from the metrics server's thread reads a copy of the counts, so it may see a
    sum one observation ahead of its counts, never a count that goes back."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float], *,
                 registry: CollectorRegistry) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds) or len(set(bounds)) != len(bounds) or math.inf in bounds:
            raise ValueError(f"{name}: buckets must be distinct and increasing, without +Inf: {buckets}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = bounds
        self._les = [floatToGoString(b) for b in (*bounds, math.inf)]  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], StepHistogramChild] = {}
        self._lock = threading.Lock()  # new series only: observations take none
        registry.register(self)

    def labels(self, *values: str) -> StepHistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, StepHistogramChild(self._bounds))
        return child

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for le, count in zip(self._les, counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(key), buckets, total)
            family.add_sample(f"{self.name}_created", dict(zip(self.labelnames, key, strict=True)), child.created)
        yield family


@dataclass
class MetricsServer:
    """prometheus-client's HTTP server in a daemon thread; :meth:`close` stops it."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self, timeout_s: float = 5.0) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout_s)


class MetricsPortError(Exception):
    """The metrics port cannot be listened on (taken, or not allowed): said in one line."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: Prometheus scrapes and probes every few seconds."""


def with_ready(app: WsgiApp, ready: ReadyCheck) -> WsgiApp:
    """``app`` with ``GET /ready`` in front: 200 ``ready``, or 503 and the reason, in one line."""
    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != READY_PATH:
            return app(environ, start_response)
        ok, reason = ready()
        body = (" ".join(reason.split()) + "\n").encode()
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]
    return routed


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0",
                  ready: ReadyCheck | None = None) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0: a free port, see ``.port``), and
    ``/ready`` when ``ready`` is given. The listen address is all interfaces by default, as
    Prometheus scrapes (and Kubernetes probes) from another host."""
    app: WsgiApp = make_wsgi_app(registry)
    if ready is not None:
        app = with_ready(app, ready)
    try:
        server = make_server(host, port, app, _ThreadingServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


def metrics_port(text: str) -> int:
    """A ``--metrics-port`` value: 0..65535 (0 picks a free port)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {text}")
    return port
