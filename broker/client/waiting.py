"""Waiting for a reply, bounded: nothing a trainer awaits waits for ever.

Three things end a wait besides the reply: the deadline (the call's ``timeout``, else the client's
``step_timeout``); the session's hash vanishing from Redis (a Redis restarted without
persistence, an operator's delete), checked every ``session_check_s``: a job in a lost Redis will
never be answered, so the waiter learns ``session_not_found`` instead of waiting out the deadline;
and, checked with it, a session that failover marked unplaced (its owner is gone and no live
worker had room: ``unplaced.lua``), which answers ``capacity_exhausted``. That step stays queued
and runs once a worker with room takes the session, like a step that timed out.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.layouts import ReplyEntry
from schemas.errors import CapacityExhaustedError, FleetError, FleetTimeoutError, SessionNotFoundError

if TYPE_CHECKING:
    from broker.client.fleet import FleetClient


def wait_bound(fleet: FleetClient, timeout: float | None) -> float | None:
    """The seconds a call waits: its own ``timeout``, else the client's default (None: no bound)."""
    return fleet.step_timeout if timeout is None else timeout


async def wait_for_reply(fleet: FleetClient, session_id: str, waiter: asyncio.Future[ReplyEntry],
                         timeout: float | None) -> ReplyEntry:
    """The reply ``waiter`` resolves to; raises FleetTimeoutError past the bound,
    SessionNotFoundError once the session is gone from Redis and CapacityExhaustedError once no
    live worker can take it."""
    bound = wait_bound(fleet, timeout)
    loop = asyncio.get_running_loop()
    deadline = None if bound is None else loop.time() + bound
    try:
        while True:
            left = fleet.session_check_s if deadline is None else min(fleet.session_check_s, deadline - loop.time())
            if left <= 0:
                raise FleetTimeoutError(f"no result within {bound}s")
            done, _ = await asyncio.wait({waiter}, timeout=left)
            if done:
                return waiter.result()
            problem = await _session_problem(fleet, session_id)
            if problem is not None:
                raise problem
    except BaseException:
        waiter.cancel()  # nobody reads it any more (a late reply is dropped by the reader)
        raise


async def _session_problem(fleet: FleetClient, session_id: str) -> FleetError | None:
    """Why the step will not be answered: the session is gone, or marked unplaced; None while it
    waits normally. An unreachable Redis counts as normal (the deadline still bounds the wait,
    and the session may well be there when Redis is back)."""
    try:
        key = fleet.keys_of(session_id).session(session_id)
        owner, unplaced = await resolve(fleet.redis.hmget(key, ["owner", "unplaced_ms"]))
    except REDIS_ERRORS:
        return None
    if owner is None:
        return SessionNotFoundError(f"session {session_id!r} no longer exists (was Redis's data lost?)")
    if unplaced is not None:
        return CapacityExhaustedError(
            f"session {session_id!r} lost its worker and no live worker has free capacity for it; the step "
            "stays queued and runs once one has (re-send the same step_id to get its stored result)")
    return None
