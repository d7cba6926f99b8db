"""Every worker takes part in reaping, so a dead worker's sessions move with nothing else started.

Each worker runs a reaping pass (:func:`broker.ops.failover.reap_exclusively`) about every half
lease, under the cell's reap lock: one process reaps at a time, whichever gets there first. The
supervisor still reaps too (it is one more contender for the lock) and keeps what only it does:
trimming and replays. The jitter keeps a fleet started at once from contending in lockstep.
"""

from __future__ import annotations

import asyncio
import logging
import random

from broker.ops.failover import FailoverReport, reap_exclusively
from broker.ops.metrics import FleetMetrics
from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
JITTER = 0.5  # each wait is interval * (1 ± JITTER/2)


def reap_interval_s(lease_ms: int) -> float:
    """Half a lease: a dead worker's sessions move within about 1.5 leases of its last heartbeat."""
    return lease_ms / 2000.0


async def reap_loop(scripts: Scripts, *, lease_ms: int, metrics: FleetMetrics | None = None) -> None:
    """Reap until cancelled; a Redis outage only skips passes. Sessions moved count in
    ``rollout_fleet_failovers_total``."""
    interval = reap_interval_s(lease_ms)
    while True:
        await asyncio.sleep(interval * (1.0 + JITTER * (random.random() - 0.5)))
        try:
            reports = await reap_exclusively(scripts, lease_ms=lease_ms)
        except REDIS_ERRORS as exc:
            raise_if_cancelling()
            log.warning("reaping pass skipped: redis unavailable (%s)", exc)
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


def _log_report(report: FailoverReport) -> None:
    if report.alive:
        return
    log.warning("worker %s lease expired: %d sessions moved (%d jobs), %d waiting, retired=%s",
                report.worker_id, len(report.moved), report.jobs_moved, len(report.stuck), report.retired)
