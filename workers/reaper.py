"""Every worker takes part in reaping, so a dead worker's sessions move with nothing else started.

Each worker looks at the cell's oldest heartbeat (one ``ZRANGE workers 0 0 WITHSCORES``, judged by
the worker's estimate of the Redis clock, workers/heartbeat.py) every half lease, or in a larger
cell less often: the cell's workers together look about :data:`CELL_LOOKS_PER_LEASE` times a lease,
whatever their number. A look that finds a lease expired runs a reaping pass
(:func:`broker.ops.failover.reap_exclusively`, under the cell's reap lock: one process reaps at a
time) at once. A look that finds the oldest lease running out before the worker's next look waits
for that expiry, asks that one worker's score again (``ZSCORE``), and reaps if it did not move: a dead
worker's sessions move right after its lease runs out. The jitter keeps a fleet started at once
from looking in lockstep. The supervisor still reaps too (one more contender for the lock) and keeps
what only it does: trimming and replays.

A dead worker is the oldest heartbeat from one heartbeat interval after its last beat until its
lease runs out; with the cell's looks :data:`CELL_LOOKS_PER_LEASE` a lease, one of them falls in
that window but for a chance that shrinks exponentially with the window (e^-16 at the defaults), and
the first look after the expiry reaps it then. Every worker used to run a full pass every half
lease: in a cell of 100 workers, 40 passes a second where now 4 looks and as many re-reads are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.ops.failover import FailoverReport, reap_exclusively, redis_now_ms
from broker.ops.metrics import FleetMetrics
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.refusals import refusal_of
from broker.redis.scripts import Scripts
from workers.heartbeat import ServerClock

log = logging.getLogger(__name__)
JITTER = 0.5  # each wait is interval * (1 ± JITTER/2)
EXPIRY_MARGIN_S = 0.02  # a pass timed for an expiry runs this much after it (plus as much jitter)
CELL_LOOKS_PER_LEASE = 20  # looks at the oldest heartbeat per lease, by the cell's workers together


def reap_interval_s(lease_ms: int) -> float:
    """Half a lease: a dead worker's sessions move within about 1.5 leases of its last heartbeat."""
    return lease_ms / 2000.0


def look_interval_s(lease_ms: int, workers: int) -> float:
    """One worker's time between looks: half a lease, longer in a cell of more than
    CELL_LOOKS_PER_LEASE / 2 workers, so that the cell's looks keep one pace."""
    return max(reap_interval_s(lease_ms), workers * lease_ms / 1000.0 / CELL_LOOKS_PER_LEASE)


@dataclass(frozen=True)
class Oldest:
    """A heartbeat a look found: whose, its score, and the Redis time of the look."""

    worker_id: str
    score: float
    now_ms: int

    def until_expiry_s(self, lease_ms: int) -> float:
        """Seconds until its lease runs out (expired_workers takes scores below now - lease)."""
        return (self.score + lease_ms + 1 - self.now_ms) / 1000.0


async def oldest_heartbeat(scripts: Scripts, clock: ServerClock | None = None, *,
                           live_within_ms: int | None = None) -> Oldest | None:
    """The cell's oldest heartbeat (with ``live_within_ms``: the oldest within that many ms; None:
    none), by the clock's estimate of the Redis time (Redis's own TIME without one)."""
    now = clock.now_ms() if clock is not None else None
    if now is None:
        now = await redis_now_ms(scripts)
    redis, key = scripts.redis, scripts.keys.workers
    raw: Any = await (redis.zrange(key, 0, 0, withscores=True) if live_within_ms is None else
                      redis.zrangebyscore(key, now - live_within_ms, "+inf", start=0, num=1, withscores=True))
    if not raw:
        return None
    wid, score = raw[0]
    return Oldest(wid.decode() if isinstance(wid, bytes) else str(wid), float(score), now)


async def reap_loop(scripts: Scripts, *, lease_ms: int, metrics: FleetMetrics | None = None,
                    clock: ServerClock | None = None, workers: Callable[[], int] = lambda: 1,
                    heartbeat_ms: int | None = None) -> None:
    """Reap until cancelled; a Redis outage only skips looks and passes. ``workers``: how many
    workers the cell has (the last full heartbeat's count); ``heartbeat_ms``: a heartbeat younger
    than 1.5 of these (at most half a lease) is taken for a live worker's and not waited on (None:
    every one is). An idle worker beats less often (workers/heartbeat.py): a reaper may wait on its
    lease, and then finds its score moved, at one ZSCORE. Sessions moved count in ``rollout_fleet_failovers_total``."""
    loop = asyncio.get_running_loop()
    quiet_ms = lease_ms / 2 if heartbeat_ms is None else min(1.5 * heartbeat_ms, lease_ms / 2)
    while True:
        wait = look_interval_s(lease_ms, workers()) * (1.0 + JITTER * (random.random() - 0.5))
        next_look = loop.time() + wait
        oldest = None
        with contextlib.suppress(*REDIS_ERRORS):  # unknown: look again after the interval
            oldest = await oldest_heartbeat(scripts, clock)
            if oldest is not None and oldest.until_expiry_s(lease_ms) <= 0:
                # An expired lease (a dead worker, or one whose sessions wait for room): reap now,
                # then time the next pass by the oldest live lease.
                await _pass(scripts, lease_ms, metrics)
                oldest = await oldest_heartbeat(scripts, clock, live_within_ms=lease_ms)
        if (oldest is not None and oldest.now_ms - oldest.score > quiet_ms
                and oldest.until_expiry_s(lease_ms) < wait):
            await asyncio.sleep(max(0.0, oldest.until_expiry_s(lease_ms)) + EXPIRY_MARGIN_S * (1.0 + random.random()))
            if await _still_there(scripts, oldest):
                await _pass(scripts, lease_ms, metrics)
        await asyncio.sleep(max(0.0, next_look - loop.time()))


async def _still_there(scripts: Scripts, oldest: Oldest) -> bool:
    """Whether the worker's score is where the look found it (a Redis error: assume so)."""
    try:
        score = await scripts.redis.zscore(scripts.keys.workers, oldest.worker_id)
    except REDIS_ERRORS:
        raise_if_cancelling()
        return True
    return score is not None and float(score) <= oldest.score


async def _pass(scripts: Scripts, lease_ms: int, metrics: FleetMetrics | None) -> None:
    try:
        reports = await reap_exclusively(scripts, lease_ms=lease_ms)
    except REDIS_ERRORS as exc:
        raise_if_cancelling()
        # A refusal is logged once a minute by the worker (Scripts.on_refusal), not every pass.
        log.log(logging.WARNING if refusal_of(exc) is None else logging.DEBUG,
                "reaping pass skipped: redis unavailable (%s)", exc)
        return
    except Exception:
        # A bug in one pass must not end reaping for the life of the worker.
        raise_if_cancelling()
        log.exception("reaping pass failed")
        return
    for report in reports or []:
        _log_report(report)
        if metrics is not None:
            metrics.failovers.inc(len(report.moved))


async def until_next_expiry_s(scripts: Scripts, *, lease_ms: int) -> float | None:
    """Seconds until the next worker lease runs out (plus EXPIRY_MARGIN_S), by Redis's clock; None
    when no live worker is registered. A lease that ran out already is the next pass's."""
    oldest = await oldest_heartbeat(scripts, live_within_ms=lease_ms)
    return None if oldest is None else max(0.0, oldest.until_expiry_s(lease_ms)) + EXPIRY_MARGIN_S


def _log_report(report: FailoverReport) -> None:
    if report.alive:
        return
    log.warning("worker %s lease expired: %d sessions moved (%d jobs), %d waiting, retired=%s",
                report.worker_id, len(report.moved), report.jobs_moved, len(report.stuck), report.retired)
