"""Failover: move a dead (or draining) worker's sessions, with their jobs, to live workers.

Reading which sessions a worker owns and which workers could take them is advisory; every move is
one atomic Lua call (``failover.lua``) that re-checks ownership, the old owner's lease and the new
owner's liveness and capacity. Running it twice, or from two supervisors at once, is harmless.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from broker.ops.cell_stats import record_failover
from broker.redis.aio import resolve
from broker.redis.connect import server_time_ms
from broker.redis.layouts import SessionHash
from broker.redis.pool_members import pool_members
from broker.redis.refusals import RedisRefused, as_refused
from broker.redis.script_replies import Alive, FailedOver, Gone, Retired, Skipped
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
SCAN_COUNT = 1000  # sessions hash fields per HSCAN page: a cell of 10,000 sessions in about 10 round trips


@dataclass
class FailoverReport:
    worker_id: str
    reason: str
    moved: dict[str, str] = field(default_factory=dict)  # session id -> new owner
    jobs_moved: int = 0
    stuck: list[str] = field(default_factory=list)  # sessions no live worker could take yet
    full: list[str] = field(default_factory=list)  # of those, the ones whose pool has live workers, all full
    alive: bool = False  # the worker heartbeated again: nothing was (or will be) moved
    retired: bool = False
    orphans: int = 0


async def redis_now_ms(scripts: Scripts) -> int:
    return await server_time_ms(scripts.redis, scripts.keys.workers)


async def expired_workers(scripts: Scripts, lease_ms: int) -> list[str]:
    """Workers whose last heartbeat is older than the lease (by the Redis clock)."""
    now = await redis_now_ms(scripts)
    raw: Any = await scripts.redis.zrangebyscore(scripts.keys.workers, "-inf", now - lease_ms - 1)
    return [w.decode() if isinstance(w, bytes) else str(w) for w in raw]


async def sessions_of(scripts: Scripts, worker_id: str) -> list[str]:
    owned: list[str] = []
    async for sid, owner in scripts.redis.hscan_iter(scripts.keys.sessions, count=SCAN_COUNT):
        if owner.decode() == worker_id:
            owned.append(sid.decode())
    return owned


@dataclass(frozen=True)
class Candidate:
    """A live worker that could take one more session of a pool, and how loaded it is."""

    worker_id: str
    owned: int  # sessions over all its pools
    capacity: int
    pressure: float  # the engine load signal of its last heartbeat, 0..1

    @property
    def share(self) -> float:
        return self.owned / self.capacity

    @property
    def score(self) -> float:
        """create.lua's load score, the same sum: session share plus engine pressure."""
        return self.share + self.pressure


async def live_members(scripts: Scripts, mode: str, model: str, *, exclude: str, lease_ms: int) -> int:
    """How many live workers (``exclude`` aside) serve the pool (mode, model), with room or not."""
    members = await pool_members(scripts.redis, scripts.keys, mode=mode, model=model)
    now = await redis_now_ms(scripts)
    return sum(m.worker_id != exclude and m.live(now, lease_ms) for m in members)


async def placement_candidates(scripts: Scripts, mode: str, model: str, *, exclude: str,
                               lease_ms: int) -> list[Candidate]:
    """Live workers of the pool (mode, model) with room for one more of its sessions (their own
    capacity and the pool's cap), least loaded first. Advisory: failover.lua checks again."""
    members = await pool_members(scripts.redis, scripts.keys, mode=mode, model=model)
    now = await redis_now_ms(scripts)
    out = [Candidate(m.worker_id, m.owned, m.capacity, m.pressure) for m in members
           if m.worker_id != exclude and m.live(now, lease_ms) and m.has_room()]
    return sorted(out, key=lambda c: c.score)  # stable: the pool's order breaks ties, as in create.lua


async def _move(scripts: Scripts, sid: str, worker_id: str, lease_ms: int, reason: str,
                report: FailoverReport) -> None:
    fields: Any = await resolve(scripts.redis.hgetall(scripts.keys.session(sid)))
    if not fields:
        return
    session = SessionHash.from_fields(fields)
    mode, model = session.mode.value, session.model
    for candidate in await placement_candidates(scripts, mode, model, exclude=worker_id, lease_ms=lease_ms):
        reply = await scripts.failover(session_id=sid, mode=mode, model=model, old=worker_id,
                                       new=candidate.worker_id, lease_ms=lease_ms, reason=reason)
        if isinstance(reply, FailedOver):
            report.moved[sid] = candidate.worker_id
            report.jobs_moved += reply.jobs_moved
            log.info("session %s: %s -> %s (epoch %s, %s jobs)", sid, worker_id, candidate.worker_id,
                     reply.epoch, reply.jobs_moved)
            return
        if isinstance(reply, Alive):
            report.alive = True
            return
        if isinstance(reply, Skipped | Gone):
            return
    report.stuck.append(sid)
    if await live_members(scripts, mode, model, exclude=worker_id, lease_ms=lease_ms):
        report.full.append(sid)


async def fail_over(scripts: Scripts, worker_id: str, *, lease_ms: int, reason: str = "expired",
                    mark_stuck: bool | None = None) -> FailoverReport:
    """Move every session of ``worker_id``; retire the worker once it owns none.

    ``reason`` is ``expired`` (only if its lease ran out) or ``handover`` (the worker drains itself).
    Sessions no live worker can take stay where they are. With ``mark_stuck`` (default: for an
    expired worker, whose sessions nobody serves) those whose pool has live workers, all of them
    full, are marked unplaced, so their trainers' waiting steps answer ``capacity_exhausted``
    (broker/client/link.py) until one moves them. A pool with no live worker at all is a fleet
    (re)starting, not a full one: its sessions wait, and their trainers see a delay.
    """
    report = FailoverReport(worker_id, reason)
    for sid in await sessions_of(scripts, worker_id):
        await _move(scripts, sid, worker_id, lease_ms, reason, report)
        if report.alive:
            return report
    if report.stuck:
        log.warning("%d sessions of %s wait for a live worker with capacity", len(report.stuck), worker_id)
        mark = reason == "expired" if mark_stuck is None else mark_stuck
        if mark:
            for sid in report.full:
                await scripts.mark_unplaced(sid, owner=worker_id)
        return report
    pools: Any = await resolve(scripts.redis.smembers(scripts.keys.pool_index))
    retired = await scripts.retire(worker_id, pools=sorted(p.decode() for p in pools), lease_ms=lease_ms,
                                   reason="expired" if reason == "expired" else "drained")
    report.alive = isinstance(retired, Alive)
    report.retired = isinstance(retired, Retired)
    report.orphans = retired.orphans if isinstance(retired, Retired) else 0
    return report


async def reap(scripts: Scripts, *, lease_ms: int) -> list[FailoverReport]:
    """One pass: fail over every worker whose lease expired; each one that moved sessions or was
    retired is noted in the cell's stats stream (the dashboard's failovers)."""
    reports = [await fail_over(scripts, wid, lease_ms=lease_ms) for wid in await expired_workers(scripts, lease_ms)]
    for report in reports:
        if report.moved or report.retired:
            await record_failover(scripts.redis, scripts.keys, report.worker_id, moved=len(report.moved),
                                  jobs=report.jobs_moved, reason=report.reason)
    return reports


async def _locked(scripts: Scripts, token: str, lease_ms: int) -> bool:
    """Take the cell's reap lock; a refused SET (OOM, MISCONF, ...) is noted and raised as
    :class:`broker.redis.refusals.RedisRefused`."""
    try:
        return bool(await scripts.redis.set(scripts.keys.supervisor_lock, token, nx=True, px=lease_ms))
    except ResponseError as exc:
        refused = as_refused(exc)
        if isinstance(refused, RedisRefused):
            scripts.note_refusal(refused)
            raise refused from exc
        raise


async def reap_exclusively(scripts: Scripts, *, lease_ms: int) -> list[FailoverReport] | None:
    """One reaping pass under the cell's reap lock; None when another process holds the lock.

    Every worker and every supervisor calls this; SET NX PX lets one of them reap at a time. The
    moves would be safe concurrently too (fenced scripts); the lock only saves duplicated work.
    The lock expires after one lease, so a reaper that dies mid-pass delays the next by that much.
    """
    redis, lock = scripts.redis, scripts.keys.supervisor_lock
    token = uuid.uuid4().hex
    if not await _locked(scripts, token, lease_ms):
        return None
    try:
        if scripts.refused_within(lease_ms / 1000.0):
            # Redis refused writes a moment ago: no worker could heartbeat meanwhile, so no lease is
            # judged until one full lease after the last refusal (docs/faults.md).
            return None
        return await reap(scripts, lease_ms=lease_ms)
    finally:
        if await redis.get(lock) == token.encode():
            await redis.delete(lock)
