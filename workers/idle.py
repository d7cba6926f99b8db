"""Abandoned sessions do not hold capacity for ever: the owner closes each session it holds that
nobody used for longer than the session's idle timeout (set at ``create_session``). The close
goes through the ordinary path (close_idle.lua enqueues the close job; apply_control.lua frees
the capacity), so the pool accounting stays right and the close keeps its order with any step
that raced it.

A sweep (every ``idle_sweep_s``) asks close_idle.lua only about the sessions whose timeout may have
run out: for a session it keeps, the script answers how long until it could be idle, and the sweep
asks again then. The sessions watched are the ones the worker serves (it knows them from their jobs)
and, when the cell's owned hash (counted by the full heartbeat, workers/heartbeat.py) says the worker
owns more than it watches (sessions placed or moved here that never sent a job), the ones a scan of
the cell's sessions hash finds; a scan also runs about every :data:`RESCAN_S`, whatever the count. An idle
worker so pays nothing per sweep, where every worker used to scan the cell's whole sessions hash.

The bound: a session the worker watches is closed within its idle timeout plus one sweep interval;
one that never sent a job here is watched from the first sweep after the full heartbeat that counts
it, so it is closed within its idle timeout plus two sweep intervals plus ten heartbeats (at the
defaults 5 s, 5 s and 1 s: the timeout plus 20 s at most).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

from broker.redis.backoff import REDIS_ERRORS, raise_if_cancelling
from broker.redis.script_replies import IdleClosed
from broker.redis.scripts import Scripts

log = logging.getLogger(__name__)
SCAN_PAGE = 512  # sessions hash entries per HSCAN call
RESCAN_S = 600.0  # a scan for sessions never served here, whatever the count says (± half, spread)


class IdleSweeper:
    """``served``: the sessions the worker holds now; ``owned``: the owned hash's count for the
    worker and a stamp that changes with each new count (None: scan at every sweep)."""

    def __init__(self, scripts: Scripts, worker_id: Callable[[], str], *, interval_s: float,
                 served: Callable[[], list[str]] = list,
                 owned: Callable[[], tuple[int, int]] | None = None) -> None:
        self.scripts = scripts
        self.worker_id = worker_id  # follows re-registrations
        self.interval_s = interval_s
        self.served = served
        self.owned = owned
        self.closed = 0  # sessions this worker closed for idleness (reported in its heartbeat)
        self.scans = 0  # scans of the sessions hash (for tests and metrics)
        self._due: dict[str, float] = {}  # watched session -> monotonic time to ask (inf: no timeout)
        self._owner = ""  # the worker id the watch list is for (a new incarnation starts anew)
        self._scan_at = 0.0  # monotonic time of the next scan whatever the count says
        self._scanned_stamp: int | None = None  # the owned count's stamp at the last scan

    def forget(self, session_id: str) -> None:
        """The worker no longer holds the session (closed, moved, fenced)."""
        self._due.pop(session_id, None)

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
        now = time.monotonic()
        if owner != self._owner:  # a start or a new incarnation: the count says whether to scan
            self._due, self._owner, self._scanned_stamp = {}, owner, None
            self._scan_at = now + RESCAN_S * (0.5 + random.random()) if self.owned is not None else now
        for sid in self.served():
            self._due.setdefault(sid, now)
        if self._scan_due(now):
            for sid in await self._owned(owner):
                self._due.setdefault(sid, now)
        due = [sid for sid, at in self._due.items() if at <= now]
        replies = await asyncio.gather(*(self.scripts.close_idle(sid, worker_id=owner) for sid in due))
        idle: list[int] = []
        for sid, reply in zip(due, replies, strict=True):
            if isinstance(reply, IdleClosed):
                idle.append(reply.idle_ms)
                self._due.pop(sid, None)
            elif reply.wait_ms is None:  # not ours (moved, or closed): nothing to watch
                self._due.pop(sid, None)
            else:
                self._due[sid] = math.inf if reply.wait_ms < 0 else now + reply.wait_ms / 1000.0
        if idle:
            self.closed += len(idle)
            log.info("closed %d idle sessions (idle up to %.0f s)", len(idle), max(idle) / 1000.0)
        return len(idle)

    def _scan_due(self, now: float) -> bool:
        """Whether to scan the sessions hash now: about every RESCAN_S, and when a new count says
        the worker owns sessions it does not watch."""
        if self.owned is None or now >= self._scan_at:
            return True
        count, stamp = self.owned()
        return stamp != self._scanned_stamp and count > len(self._due)

    async def _owned(self, owner: str) -> list[str]:
        """The sessions the cell's sessions hash gives to ``owner`` (a paged scan)."""
        if self.owned is not None:
            self._scanned_stamp = self.owned()[1]
        self._scan_at = time.monotonic() + RESCAN_S * (0.5 + random.random())
        self.scans += 1
        redis, mine, cursor = self.scripts.redis, [], 0
        wanted = owner.encode()
        while True:
            page: Any
            cursor, page = await redis.hscan(self.scripts.keys.sessions, cursor, count=SCAN_PAGE)
            mine += [sid.decode() for sid, held_by in page.items() if held_by == wanted]
            if cursor == 0:
                return mine
