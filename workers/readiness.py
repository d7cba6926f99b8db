"""Engine readiness: a worker whose engine cannot run steps now takes no new sessions.

The heartbeat loop asks the engine (:meth:`Engine.ready`, bounded by ``READY_TIMEOUT_S``) once per
beat. Not ready: the worker's capacity in the cell becomes 0 (``set_capacity.lua``), so placement
and failover skip it, and its registry hash says ``engine_ready=0`` with the reason. Its sessions
stay: their steps still reach it and fail or succeed on their own. Ready again: the configured
capacity comes back. Capacity rather than leaving the placement pools: a pool entry's score is the
worker's load, which a close or a failover updates while it is away; leaving would lose it.

A probe that overlaps the worker's own weight update (``busy``) is discarded: a server reloading
weights at our request can answer its health check late, and taking that for a failed engine would
refuse new sessions (``capacity_exhausted``) right after every update until the next probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from broker.ops.metrics import FleetMetrics
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.scripts import Scripts
from workers.engines.base import Engine

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 3.0  # above the HTTP engines' own probe timeout (2 s), so theirs names the cause


class Readiness:
    def __init__(self, engine: Engine, *, capacity: int, metrics: FleetMetrics,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.engine = engine
        self.capacity = capacity
        self.metrics = metrics
        self.busy = busy  # the worker holds the engine for a weight update
        self.ready = True
        self.reason = ""

    @property
    def offered_capacity(self) -> int:
        """The capacity to register with: 0 while the engine is not ready."""
        return self.capacity if self.ready else 0

    async def probe(self) -> None:
        """Ask the engine; record the answer (no Redis). An answer given while a weight update held
        the engine, at the probe's start or end, is not recorded."""
        busy_at_start = self.busy()
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                ok = await self.engine.ready()
            reason = "" if ok else "the engine reports it is not ready"
        except TimeoutError:
            ok, reason = False, f"readiness check took over {READY_TIMEOUT_S:g}s"
        except Exception as exc:  # any failure of the probe means "not ready", with its reason
            # One line: the registry's reason ends up in status's table row and --check's answer.
            ok, reason = False, " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if busy_at_start or self.busy():
            return
        if ok != self.ready:
            if ok:
                log.info("engine ready again; taking new sessions")
            else:
                log.warning("engine not ready (%s); taking no new sessions", reason)
        self.ready, self.reason = ok, reason
        self.metrics.engine_ready.set(1 if ok else 0)

    async def check(self, scripts: Scripts, worker_id: str) -> None:
        """Probe, then offer the capacity that goes with the answer. Written every beat while not
        ready (a re-registration restores the full capacity) and once when ready again."""
        was_ready = self.ready
        await self.probe()
        if not self.ready or not was_ready:
            await scripts.set_capacity(worker_id, self.offered_capacity, fields=self.fields())

    async def follow(self, scripts: Scripts, worker_id: Callable[[], str], interval_ms: int) -> None:
        """Check once per heartbeat interval until cancelled. Its own task, so that a slow probe
        never delays a heartbeat (the lease does not wait for the engine)."""
        while True:
            await asyncio.sleep(interval_ms / 1000.0)
            try:
                await self.check(scripts, worker_id())
            except REDIS_ERRORS as exc:  # the next beat tries again; the probe's answer is kept
                raise_if_cancelling()
                log.warning("could not offer capacity %d: %s", self.offered_capacity, exc)

    def fields(self) -> dict[str, str]:
        """The registry hash's view of it."""
        return {"engine_ready": "1" if self.ready else "0", "engine_reason": self.reason}
