"""Waiting for a reply, bounded: nothing a trainer awaits waits for ever.

Two things end a wait besides the reply: the deadline (the call's ``timeout``, else the client's
``step_timeout``), and the session's hash vanishing from Redis (a Redis restarted without
persistence, an operator's delete), checked every ``session_check_s``: a job in a lost Redis will
never be answered, so the waiter learns ``session_not_found`` instead of waiting out the deadline.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from broker.redis.backoff import REDIS_ERRORS
from broker.redis.layouts import ReplyEntry
from schemas.errors import FleetTimeoutError, SessionNotFoundError

if TYPE_CHECKING:
    from broker.client.fleet import FleetClient


def wait_bound(fleet: FleetClient, timeout: float | None) -> float | None:
    """The seconds a call waits: its own ``timeout``, else the client's default (None: no bound)."""
    return fleet.step_timeout if timeout is None else timeout


async def wait_for_reply(fleet: FleetClient, session_id: str, waiter: asyncio.Future[ReplyEntry],
                         timeout: float | None) -> ReplyEntry:
    """The reply ``waiter`` resolves to; raises FleetTimeoutError past the bound and
    SessionNotFoundError once the session is gone from Redis."""
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
            if not await _session_exists(fleet, session_id):
                raise SessionNotFoundError(f"session {session_id!r} no longer exists (was Redis's data lost?)")
    except BaseException:
        waiter.cancel()  # nobody reads it any more (a late reply is dropped by the reader)
        raise


async def _session_exists(fleet: FleetClient, session_id: str) -> bool:
    """Whether the session's hash is in Redis; an unreachable Redis counts as yes (the deadline
    still bounds the wait, and the session may well be there when Redis is back)."""
    try:
        return bool(await fleet.redis.exists(fleet.keys_of(session_id).session(session_id)))
    except REDIS_ERRORS:
        return True
