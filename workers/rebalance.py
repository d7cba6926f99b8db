"""Rebalancing: a busy worker hands sessions to less loaded ones, so new workers take load.

Every ``rebalance_interval_s`` (with jitter) each active worker compares its session share
(sessions owned over all its pools / capacity) with the least loaded live worker that could take
each of its sessions. While its own share exceeds that worker's by more than
``rebalance_threshold`` (and the move does not merely swap who is busier), it moves one session
through ``failover.lua`` (reason ``rebalance``): owner and epoch + 1, queued jobs moved in order,
exactly as a drain's handover. Only sessions between steps move (no job of theirs running or
queued on this worker): the trainer sees a step answered by the new owner, which rebuilds the
context first, and no error. A job that slips in between is fenced here and runs on the new owner.

A session of a trainer stepping closed-loop is between steps only for the moment from its commit to
its next job's arrival. So a pass reads what it needs from Redis first, then picks from the sessions
between steps at that very moment and moves one at once; while a move is worth making and no
session is between steps, it waits (up to one interval) for one to finish its step.

The decision uses session share, not engine pressure: a move changes share by a known step,
while running steps swing with every batch and would make sessions flap between workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from broker.ops.failover import Candidate, placement_candidates
from broker.ops.metrics import FleetMetrics
from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.script_replies import FailedOver
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
JITTER = 0.5  # each wait is interval * (1 ± JITTER/2): workers started together do not move in lockstep

# A session this worker could move now: (session id, mode, model).
Movable = tuple[str, str, str]


def worth_moving(owned: int, capacity: int, target: Candidate, threshold: float) -> bool:
    """Move one session to ``target`` only while our share exceeds its share by more than the
    threshold, and never so far that the target ends up busier than we are."""
    ours = owned / capacity
    return ours - target.share > threshold and (owned - 1) / capacity >= (target.owned + 1) / target.capacity


@dataclasses.dataclass
class Rebalancer:
    scripts: Scripts
    worker_id: Callable[[], str]
    movable: Callable[[], list[Movable]]  # sessions between steps
    forget: Callable[[str], None]  # drop a moved session's state here
    active: Callable[[], bool]  # false while draining or stopping
    interval_s: float
    threshold: float
    lease_ms: int
    metrics: FleetMetrics
    # An estimate of our session share (the last full heartbeat's count over our capacity): a pass
    # is skipped, with no Redis call, while it says no session could be worth moving.
    share_hint: Callable[[], float] = lambda: 1.0
    # Every session here, between steps or not (the pools a pass asks about); default: ``movable``.
    serving: Callable[[], list[Movable]] | None = None
    # Wait up to the given seconds for a session here to finish its step (returns early when one
    # does); default: a short sleep.
    between_steps: Callable[[float], Awaitable[None]] = lambda timeout: asyncio.sleep(min(timeout, 0.01))

    async def run(self) -> None:
        """Check until cancelled; a Redis outage or a bug only skips a pass."""
        while True:
            await asyncio.sleep(self.interval_s * (1.0 + JITTER * (random.random() - 0.5)))
            if not self.active():
                continue
            try:
                await self.pass_once()
            except REDIS_ERRORS as exc:
                log.warning("rebalancing pass skipped: redis unavailable (%s)", exc)
            except Exception:
                log.exception("rebalancing pass failed")

    async def pass_once(self) -> int:
        """One pass; how many sessions moved. Waits up to one interval for a session to come
        between steps while a move is worth making and none is."""
        serving = self._serving()
        if self.share_hint() <= self.threshold or not serving:
            return 0  # no share to shed (ours minus any target's is at most ours), or no session here
        me = self.worker_id()
        redis, keys = self.scripts.redis, self.scripts.keys
        capacity_raw: Any = await resolve(redis.hget(keys.capacity, me))
        owned_raw: Any = await resolve(redis.hget(keys.owned, me))
        capacity, owned = int(capacity_raw or 0), int(owned_raw or 0)
        if capacity <= 0 or owned <= 0:
            return 0
        targets = await self._targets(me, serving)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.interval_s
        moved = 0
        while self.active():
            # Picked from the sessions between steps now, and moved with no other await first.
            pick = self._pick(self.movable(), owned, capacity, targets)
            if pick is None:
                left = deadline - loop.time()
                if left <= 0 or self._pick(self._serving(), owned, capacity, targets) is None:
                    break  # nothing worth moving, or nothing came between steps in time
                await self.between_steps(left)
                continue
            (session_id, mode, model), target = pick
            pool = targets[(mode, model)]
            pool.remove(target)
            if await self._move(me, session_id, mode, model, target.worker_id):
                owned, moved = owned - 1, moved + 1
                target = dataclasses.replace(target, owned=target.owned + 1)
                if target.owned < target.capacity:
                    pool.append(target)
        if moved:
            log.info("rebalance: moved %d sessions to less loaded workers (%d left here, capacity %d)",
                     moved, owned, capacity)
            self.metrics.rebalanced.inc(moved)
        return moved

    def _serving(self) -> list[Movable]:
        return (self.serving or self.movable)()

    async def _targets(self, me: str, serving: list[Movable]) -> dict[tuple[str, str], list[Candidate]]:
        """The live workers that could take a session, per (mode, model) served here."""
        targets: dict[tuple[str, str], list[Candidate]] = {}
        for _, mode, model in serving:
            if (mode, model) not in targets:
                targets[(mode, model)] = await placement_candidates(self.scripts, mode, model, exclude=me,
                                                                    lease_ms=self.lease_ms)
        return targets

    def _pick(self, sessions: list[Movable], owned: int, capacity: int,
              targets: dict[tuple[str, str], list[Candidate]]) -> tuple[Movable, Candidate] | None:
        """The first of ``sessions`` worth moving, with the least loaded worker to take it."""
        for session in sessions:
            _, mode, model = session
            target = min(targets.get((mode, model), ()), key=lambda c: c.share, default=None)
            if target is not None and worth_moving(owned, capacity, target, self.threshold):
                return session, target
        return None

    async def _move(self, me: str, session_id: str, mode: str, model: str, target: str) -> bool:
        reply = await self.scripts.failover(session_id=session_id, mode=mode, model=model, old=me, new=target,
                                            lease_ms=self.lease_ms, reason="rebalance")
        if not isinstance(reply, FailedOver):
            return False  # it moved or closed meanwhile, or the target filled up: failover.lua said no
        self.forget(session_id)
        log.debug("rebalance: session %s -> %s (epoch %s, %s jobs)", session_id, target, reply.epoch,
                  reply.jobs_moved)
        return True
