"""Abandoned sessions do not hold capacity for ever: the owner closes each session it holds that
nobody used for longer than the session's idle timeout (set at ``create_session``). The close
goes through the ordinary path (close_idle.lua enqueues the close job; apply_control.lua frees
the capacity), so the pool accounting stays right and the close keeps its order with any step
that raced it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
SCAN_PAGE = 512  # sessions hash entries per HSCAN call


class IdleSweeper:
    def __init__(self, scripts: Scripts, worker_id: Callable[[], str], *, interval_s: float) -> None:
        self.scripts = scripts
        self.worker_id = worker_id  # follows re-registrations
        self.interval_s = interval_s
        self.closed = 0  # sessions this worker closed for idleness (reported in its heartbeat)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except REDIS_ERRORS as exc:  # the next round tries again
                raise_if_cancelling()
                log.warning("idle-session sweep failed: %s", exc)

    async def sweep(self) -> int:
        """Close this worker's sessions that are idle past their timeout; how many it closed."""
        owner = self.worker_id()
        idle = await asyncio.gather(*(self.scripts.close_idle(sid, worker_id=owner)
                                      for sid in await self._owned(owner)))
        closed = sum(1 for ms in idle if ms is not None)
        if closed:
            self.closed += closed
            log.info("closed %d idle sessions (idle up to %.0f s)", closed,
                     max(ms for ms in idle if ms is not None) / 1000.0)
        return closed

    async def _owned(self, owner: str) -> list[str]:
        """The sessions the cell's sessions hash gives to ``owner`` (a paged scan)."""
        redis, mine, cursor = self.scripts.redis, [], 0
        wanted = owner.encode()
        while True:
            page: Any
            cursor, page = await redis.hscan(self.scripts.keys.sessions, cursor, count=SCAN_PAGE)
            mine += [sid.decode() for sid, held_by in page.items() if held_by == wanted]
            if cursor == 0:
                return mine
