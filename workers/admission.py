"""Admission of inbox entries into running jobs (``max_inflight``), interactive first.

The reader admits entries in inbox order. With plain slots, a reader blocked on a bulk entry
would leave an interactive entry behind it unread until that bulk entry got its slot. Here a bulk
entry that finds no slot waits in a bounded backlog of its own (``backlog``: the reader reads on
until that many wait), and a freed slot goes to an interactive entry first, then to the backlog
in order. Order per session holds: once a session has an entry in the backlog, its later entries
(whatever their class) queue behind it; a session's other jobs go to its lane, one at a time.
``acquire``/``release`` keep the semaphore's interface for code that needs one slot.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from schemas.sharing import Priority
from workers.jobs import BadJob, Job


class Admission:
    def __init__(self, limit: int, backlog: int) -> None:
        self._free = limit
        self._backlog_limit = max(1, backlog)
        self._backlog: collections.deque[tuple[Job | BadJob, Callable[[Job | BadJob], None]]] = collections.deque()
        self._held: collections.Counter[str] = collections.Counter()  # sessions in the backlog
        self._held_ids: set[str] = set()  # entry ids in the backlog (a history read skips them)
        self._interactive_waiting = 0
        self._changed = asyncio.Event()  # set on every release

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    @property
    def interactive_waiting(self) -> int:
        return self._interactive_waiting

    def holds(self, entry_id: str) -> bool:
        """Whether the entry waits in the backlog (read, not dispatched yet)."""
        return entry_id in self._held_ids

    async def acquire(self) -> None:
        """One slot, as a semaphore gives it."""
        while self._free <= 0:
            self._changed.clear()
            await self._changed.wait()
        self._free -= 1

    def release(self) -> None:
        self._free += 1
        if not self._interactive_waiting:  # a waiting interactive entry takes this slot first
            self._run_backlog()
        self._changed.set()

    async def admit(self, job: Job | BadJob, dispatch: Callable[[Job | BadJob], None]) -> None:
        """``dispatch(job)`` now or once a slot frees; returns when the reader may read on."""
        session = job.session_id or ""
        if isinstance(job, Job) and job.priority is Priority.INTERACTIVE and session not in self._held:
            self._interactive_waiting += 1
            try:
                await self.acquire()
            except BaseException:  # the reader stops: slots it left alone go to the backlog
                self._interactive_waiting -= 1
                self._run_backlog()
                raise
            self._interactive_waiting -= 1
            dispatch(job)
            self._run_backlog()  # slots freed while it waited and left for it
            return
        if self._free > 0 and not self._backlog:
            self._free -= 1
            dispatch(job)
            return
        self._backlog.append((job, dispatch))
        self._held[session] += 1
        self._held_ids.add(job.entry_id)
        while len(self._backlog) >= self._backlog_limit:
            self._changed.clear()
            await self._changed.wait()

    def _run_backlog(self) -> None:
        while self._free > 0 and self._backlog:
            job, dispatch = self._backlog.popleft()
            session = job.session_id or ""
            self._held[session] -= 1
            if not self._held[session]:
                del self._held[session]
            self._held_ids.discard(job.entry_id)
            self._free -= 1
            dispatch(job)
