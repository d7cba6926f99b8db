"""A client's link to one cell: what a session needs to run its calls there, and nothing more.

A :class:`CellLink` holds the cell's keys, its scripts, this client's reply reader in the cell,
the client's id and limits, and the bounds its waits obey. :class:`broker.client.session.Session`
holds one, never the :class:`broker.client.fleet.FleetClient` that made it, so the client's modules
import one way: fleet -> session -> link.

Waiting for a reply is bounded: nothing a trainer awaits waits for ever. Three things end a wait
besides the reply: the deadline (the call's ``timeout``, else the client's ``step_timeout``); the
session's hash vanishing from Redis (a Redis restarted without persistence, an operator's delete),
checked every ``session_check_s``: a job in a lost Redis will never be answered, so the waiter
learns ``session_not_found`` instead of waiting out the deadline; and, checked with it, a session
that failover marked unplaced (its owner is gone and no live worker had room: ``unplaced.lua``),
which answers ``capacity_exhausted``. That step stays queued and runs once a worker with room
takes the session, like a step that timed out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis

from broker.client.replies import ReplyReader
from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.keys import CellKeys
from broker.redis.layouts import ReplyEntry, SessionHash
from broker.redis.scripts import Scripts
from schemas.errors import (
    CapacityExhaustedError,
    ErrorCode,
    FleetError,
    FleetTimeoutError,
    SessionNotFoundError,
    error_for,
)
from schemas.limits import Limits
from schemas.messages import SessionStatus, StepResult


@dataclass(frozen=True)
class Bounds:
    """How long a client's calls wait: a step or reset without its own ``timeout`` waits
    ``step_timeout`` at most (None: no bound), checking every ``session_check_s`` that its session
    still exists; a call rides out an unreachable Redis for ``reconnect_s``."""

    step_timeout: float | None
    session_check_s: float
    reconnect_s: float

    def wait_s(self, timeout: float | None) -> float | None:
        """The seconds a call waits: its own ``timeout``, else the client's default."""
        return self.step_timeout if timeout is None else timeout


@dataclass
class CellLink:
    """What a client uses in one cell: its keys, its scripts, this client's reply stream there,
    the client's id and limits, and its bounds."""

    redis: Redis
    keys: CellKeys
    scripts: Scripts
    replies: ReplyReader
    client_id: str
    limits: Limits
    bounds: Bounds

    def link_for(self, session_id: str) -> CellLink:
        """This link (a branch of a session lives in its parent's cell)."""
        return self

    def decode_result(self, reply: ReplyEntry, started: float) -> StepResult:
        """A reply entry as a StepResult, with the current committed id and the client's timing."""
        return decode_result(reply, started, self.limits)

    async def status(self, session_id: str) -> SessionStatus:
        return await session_status(self.redis, self.keys, session_id)

    async def wait_for_reply(self, session_id: str, waiter: asyncio.Future[ReplyEntry],
                             timeout: float | None) -> ReplyEntry:
        """The reply ``waiter`` resolves to; raises FleetTimeoutError past the bound,
        SessionNotFoundError once the session is gone from Redis and CapacityExhaustedError once no
        live worker can take it."""
        bound = self.bounds.wait_s(timeout)
        check_s = self.bounds.session_check_s
        loop = waiter.get_loop()
        deadline = None if bound is None else loop.time() + bound
        try:
            while True:
                left = check_s if deadline is None else min(check_s, deadline - loop.time())
                if left <= 0:
                    raise FleetTimeoutError(f"no result within {bound}s")
                if await _settles_within(waiter, left):
                    return waiter.result()
                problem = await self._session_problem(session_id)
                if problem is not None:
                    raise problem
        except BaseException:
            waiter.cancel()  # nobody reads it any more (a late reply is dropped by the reader)
            raise

    async def _session_problem(self, session_id: str) -> FleetError | None:
        """Why the step will not be answered: the session is gone, or marked unplaced; None while it
        waits normally. An unreachable Redis counts as normal (the deadline still bounds the wait,
        and the session may well be there when Redis is back)."""
        try:
            owner, unplaced = await resolve(self.redis.hmget(self.keys.session(session_id),
                                                             ["owner", "unplaced_ms"]))
        except REDIS_ERRORS:
            return None
        if owner is None:
            return SessionNotFoundError(f"session {session_id!r} no longer exists (was Redis's data lost?)")
        if unplaced is not None:
            return CapacityExhaustedError(
                f"session {session_id!r} lost its worker and no live worker has free capacity for it; the step "
                "stays queued and runs once one has (re-send the same step_id to get its stored result)")
        return None


async def _settles_within(waiter: asyncio.Future[Any], seconds: float) -> bool:
    """Whether ``waiter`` is done after at most ``seconds``; never cancels it. ``asyncio.wait`` for
    one future, without its per-call set, task wrapping and loop lookup (a step waits once)."""
    if waiter.done():
        return True
    loop = waiter.get_loop()
    woken = loop.create_future()

    def wake(_: object) -> None:
        if not woken.done():
            woken.set_result(None)

    timer = loop.call_later(seconds, wake, None)
    waiter.add_done_callback(wake)
    try:
        await woken
    finally:
        timer.cancel()
        waiter.remove_done_callback(wake)
    return waiter.done()


class LinkSource(Protocol):
    """Whatever hands a session its cell link: a :class:`broker.client.fleet.FleetClient`, or a
    :class:`CellLink` itself (for branches in the same cell)."""

    def link_for(self, session_id: str) -> CellLink: ...


def decode_result(reply: ReplyEntry, started: float, limits: Limits) -> StepResult:
    """A reply entry as a StepResult, with the current committed id and the client's timing."""
    return reply.step_result(limits, total_ms=(time.perf_counter() - started) * 1000.0)


async def session_status(redis: Redis, keys: CellKeys, session_id: str) -> SessionStatus:
    """A session's status from its hash; session_not_found when there is none."""
    raw: Any = await resolve(redis.hgetall(keys.session(session_id)))
    if not raw:
        raise error_for(ErrorCode.SESSION_NOT_FOUND, f"session {session_id!r} does not exist")
    return SessionHash.from_fields(raw).status(session_id)
