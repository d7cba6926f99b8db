"""Waiting out a Redis outage: one exponential backoff for every loop that retries Redis.

Every retry loop of the fleet starts at 50 ms and doubles up to 2 s: short enough that a Redis
restart (AOF reload, failover) costs a trainer well under a second of extra wait, long enough that
a fleet of workers does not hammer a Redis that is coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.redis.refusals import BusyScriptError, MisconfError, NoReplicasError, UnblockedError, refusal_of

log = logging.getLogger(__name__)
T = TypeVar("T")
# "Redis is unavailable, try again later". On a Redis Cluster a failover shows as more than a
# refused connection: CLUSTERDOWN / MASTERDOWN (ClusterError), TRYAGAIN during a slot move, a
# MOVED/ASK the client still chased after its own retries (AskError, MovedError's base), "TTL
# exhausted" (ClusterError) and a slot no known node serves (SlotNotCoveredError). redis-py's
# cluster client retries these itself a few times first. A CROSSSLOT error is a bug, not listed.
# A Redis that refuses writes for a while (OOM, MISCONF, READONLY, NOREPLICAS, BUSY, and the
# UNBLOCKED of a blocked read as a master turns replica: broker/redis/refusals.py) is unavailable
# the same way.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, ClusterError, TryAgainError, AskError,
                SlotNotCoveredError, OutOfMemoryError, ReadOnlyError, MisconfError, BusyScriptError, NoReplicasError,
                UnblockedError)
START_S = 0.05
CAP_S = 2.0


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a library turned into an error. A retry loop that caught such
    an error and slept on would outlive its ``cancel()`` (the request is delivered once), and the
    shutdown awaiting it would wait for ever. Called first in every retry loop's error handler."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait until each has ended. Their cancellation ends here; one of the
    caller's own that arrives meanwhile does not: it raises ``CancelledError``
    (``suppress(CancelledError)`` around the await would swallow both, and whoever cancelled the
    caller, a shutdown or a deadline, would wait on a caller that no longer stops). A cleanup in a
    ``finally`` of a cancelled caller still waits for them all. A task's own exception propagates."""
    for task in tasks:
        task.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):  # CancelledError is a BaseException: theirs ends here
            raise outcome


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` seconds; whether it is. A cancellation of
    the caller always propagates: ``asyncio.wait_for`` on Python 3.11 returns normally instead when
    the cancel arrives in the turn its awaitable finishes, and a loop around it then never stops
    (tests/test_backoff.py). ``asyncio.timeout`` has no such window."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


class Backoff:
    """Delays that double after every wait, up to ``cap``; ``reset`` after a success.

    ``jitter`` spreads each wait over ``delay * (1 ± jitter/2)`` so that many waiters do not come
    back in the same instant; 0 waits exactly ``delay``."""

    def __init__(self, start: float = START_S, cap: float = CAP_S, jitter: float = 0.0) -> None:
        self.start = start
        self.cap = cap
        self.jitter = jitter
        self.delay = start

    def reset(self) -> None:
        self.delay = self.start

    async def wait(self) -> None:
        """Sleep the current delay, then double it (up to the cap)."""
        raise_if_cancelling()
        await asyncio.sleep(self.take())

    def take(self) -> float:
        """The current delay (with its jitter), doubling it for next time: for a caller that waits
        on something else meanwhile (a stop event)."""
        spread = 1.0 + self.jitter * (random.random() - 0.5)
        delay = self.delay * spread
        self.delay = min(2 * self.delay, self.cap)
        return delay


async def until_redis_answers(call: Callable[[], Awaitable[T]], what: str) -> T:
    """Retry a Redis call with backoff until Redis answers. Only for calls that are safe to repeat:
    the commit, report and control scripts are (a repeated commit is answered as a duplicate)."""
    backoff = Backoff()
    while True:
        try:
            return await call()
        except (*REDIS_ERRORS, ResponseError) as exc:
            if not isinstance(exc, REDIS_ERRORS) and refusal_of(exc) is None:
                raise  # an error reply that is not a refusal (a bug): retrying would not help
            # A refusal lasts as long as the operator takes: every waiting call would warn each time;
            # its cause is logged once a minute by whoever watches Scripts.on_refusal.
            level = logging.WARNING if refusal_of(exc) is None else logging.DEBUG
            log.log(level, "%s: redis unavailable (%s); retrying in %.2fs", what, exc, backoff.delay)
            await backoff.wait()
