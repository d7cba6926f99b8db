"""The drain's handover: move every session to live workers, and keep serving the ones nobody can take.

A draining worker has left the placement pools and finished (or given up on) the jobs it had read.
It hands its sessions over through ``failover.lua`` (reason ``handover``, no lease wait). Sessions
that find no live worker with free capacity stay here: the worker says so in its log, in its
registry hash (``drain_stuck``, shown by ``rollout-fleet status``) and in the
``rollout_fleet_drain_stuck_sessions`` gauge, reads its inbox again so their steps keep being
served, and tries the handover again every heartbeat interval until every session has moved or
the drain timeout (counted from the start of the drain) has passed. Then the sessions still here
whose pool has live workers, all full, are marked unplaced (their trainers' waiting steps answer
``capacity_exhausted``); where no other worker is live at all, their steps just wait. Either way
they move once a worker has room, after this one's lease expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.ops.failover import FailoverReport, fail_over
from broker.ops.metrics import FleetMetrics
from broker.redis.backoff import cancel_and_wait
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)


@dataclass
class Drain:
    scripts: Scripts
    worker_id: str
    lease_ms: int
    retry_s: float  # between handover attempts while sessions are stuck
    forget: Callable[[str], None]  # drop a handed-over session's state here
    metrics: FleetMetrics
    stuck: int = 0  # sessions the last attempt could not hand over (the registry's drain_stuck)

    async def hand_over(self, *, final: bool) -> FailoverReport:
        """One attempt; ``final`` marks the sessions stuck for want of room as unplaced."""
        report = await fail_over(self.scripts, self.worker_id, lease_ms=self.lease_ms, reason="handover",
                                 mark_stuck=final)
        for session_id in report.moved:
            self.forget(session_id)
        self.stuck = len(report.stuck)
        self.metrics.drain_stuck.set(self.stuck)
        return report

    async def run(self, deadline: float, keep_serving: Callable[[], asyncio.Task[Any]]) -> None:
        """Hand everything over, serving stuck sessions (``keep_serving`` starts reading the inbox
        again) until they move or the loop clock passes ``deadline``."""
        loop = asyncio.get_running_loop()
        report = await self.hand_over(final=False)
        moved, jobs = len(report.moved), report.jobs_moved
        if report.stuck and loop.time() < deadline:
            log.warning("drain: %d sessions found no live worker with free capacity; serving them until one "
                        "has room (at most %.1fs more)", len(report.stuck), deadline - loop.time())
            reader = keep_serving()
            try:
                while report.stuck and loop.time() < deadline:
                    await asyncio.sleep(max(0.0, min(self.retry_s, deadline - loop.time())))
                    report = await self.hand_over(final=False)
                    moved, jobs = moved + len(report.moved), jobs + report.jobs_moved
            finally:
                await cancel_and_wait(reader)
        if report.stuck:
            report = await self.hand_over(final=True)
            moved, jobs = moved + len(report.moved), jobs + report.jobs_moved
        if report.stuck:
            log.warning("drain: %d sessions still found no live worker with free capacity; they move once one "
                        "has room (%d marked unplaced: the live workers of their pools are full, so their "
                        "trainers get capacity_exhausted meanwhile)", len(report.stuck), len(report.full))
        log.info("drain: handed over %d sessions (%d queued jobs)", moved, jobs)
