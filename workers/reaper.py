"""Every worker takes part in reaping, so a dead worker's sessions move with nothing else started.

Each worker runs a reaping pass (:func:`broker.ops.failover.reap_exclusively`) about every half
lease, under the cell's reap lock: one process reaps at a time, whichever gets there first. The
supervisor still reaps too (it is one more contender for the lock) and keeps what only it does:
trimming and replays. The jitter keeps a fleet started at once from contending in lockstep.

A pass due after the next lease expiry runs at that expiry instead (by Redis's clock, the workers'
heartbeat scores): a dead worker's sessions move right after its lease runs out rather than up to
a reaping interval later, at the cost of one small read per wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from broker.ops.failover import FailoverReport, reap_exclusively, redis_now_ms
from broker.ops.metrics import FleetMetrics
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.refusals import refusal_of
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
JITTER = 0.5  # each wait is interval * (1 ± JITTER/2)
EXPIRY_MARGIN_S = 0.02  # a pass timed for an expiry runs this much after it (plus as much jitter)


def reap_interval_s(lease_ms: int) -> float:
    """Half a lease: a dead worker's sessions move within about 1.5 leases of its last heartbeat."""
    return lease_ms / 2000.0


async def reap_loop(scripts: Scripts, *, lease_ms: int, metrics: FleetMetrics | None = None) -> None:
    """Reap until cancelled; a Redis outage only skips passes. Sessions moved count in
    ``rollout_fleet_failovers_total``."""
    interval = reap_interval_s(lease_ms)
    while True:
        wait = interval * (1.0 + JITTER * (random.random() - 0.5))
        with contextlib.suppress(*REDIS_ERRORS):  # unknown: the interval it is
            until = await until_next_expiry_s(scripts, lease_ms=lease_ms)
            if until is not None and until < wait:
                wait = until + EXPIRY_MARGIN_S * random.random()
        await asyncio.sleep(wait)
        try:
            reports = await reap_exclusively(scripts, lease_ms=lease_ms)
        except REDIS_ERRORS as exc:
            raise_if_cancelling()
            # A refusal is logged once a minute by the worker (Scripts.on_refusal), not every pass.
            log.log(logging.WARNING if refusal_of(exc) is None else logging.DEBUG,
                    "reaping pass skipped: redis unavailable (%s)", exc)
            continue
        except Exception:
            # A bug in one pass must not end reaping for the life of the worker.
            raise_if_cancelling()
            log.exception("reaping pass failed")
            continue
        for report in reports or []:
            _log_report(report)
            if metrics is not None:
                metrics.failovers.inc(len(report.moved))


async def until_next_expiry_s(scripts: Scripts, *, lease_ms: int) -> float | None:
    """Seconds until the next worker lease runs out (plus EXPIRY_MARGIN_S); None when no live
    worker is registered. A lease that ran out already is the next pass's, whenever it comes."""
    now = await redis_now_ms(scripts)
    raw = await scripts.redis.zrangebyscore(scripts.keys.workers, now - lease_ms, "+inf", start=0, num=1,
                                            withscores=True)
    if not raw:
        return None
    expiry_ms = float(raw[0][1]) + lease_ms + 1  # expired_workers takes scores below now - lease_ms
    return max(0.0, expiry_ms - now) / 1000.0 + EXPIRY_MARGIN_S


def _log_report(report: FailoverReport) -> None:
    if report.alive:
        return
    log.warning("worker %s lease expired: %d sessions moved (%d jobs), %d waiting, retired=%s",
                report.worker_id, len(report.moved), report.jobs_moved, len(report.stuck), report.retired)
