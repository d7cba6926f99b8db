"""Cancel and fork on the worker (``Session.cancel``, ``Session.fork``).

cancel: the reader hands a session's ``cancel`` entry here as soon as it reads it, ahead of the
session's queued steps: later steps enqueued before the cancel answer ``cancelled`` when their turn
comes (without running), a step waiting at the weight gate stops waiting, and the running one is
aborted where the engine can (``Engine.abort_session``). cancel.lua already did everything in
Redis, so the entry is only acknowledged. commit.lua refuses the commit of any step enqueued
before the cancel: this module makes cancels quick, not correct.

fork: the parent's ``fork`` entry runs in the parent's lane. fork.lua refused the fork unless the
parent had no step queued, so the parent's engine context is its committed step (the fork point,
the entry's step_id) unless a failed or cancelled step made it drop it. Then the engine copies it
into every branch this worker owns and has not started yet (``Engine.fork_session``); a branch the
engine did not get rebuilds from its copied records on its first step, like a session taken over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from broker.redis.aio import resolve
from broker.redis.inbox import InboxEntry
from broker.redis.layouts import SessionHash
from workers.executor import SessionState, StepExecutor
from workers.job_scripts import settled

log = logging.getLogger(__name__)


class ForkCancel:
    """The worker's handling of a session's cancel and fork entries."""

    def __init__(self, executor: Callable[[], StepExecutor], sessions: dict[str, SessionState]) -> None:
        self._executor = executor  # the worker's, once started
        self._sessions = sessions  # the worker's sessions at their epochs (shared, not copied)

    def cancel(self, job: InboxEntry) -> Coroutine[Any, Any, None]:
        """Act on a cancel entry now (synchronously: before the reader hands out anything after it);
        returns the acknowledgement of the entry, to run as a job."""
        executor = self._executor()
        executor.cancels.record(job.session_id, job.cancels)
        executor.stop_gate_waits(job.session_id)
        aborted = executor.engine.abort_session(job.session_id)
        log.info("session %s cancelled (cancel %d; running step aborted: %s)", job.session_id, job.cancels,
                 aborted)
        return self._ack(job)

    async def fork(self, job: InboxEntry, state: SessionState) -> None:
        """The parent's lane reached its fork entry: copy its context into the branches, then ack."""
        branches = job.payload.decode("utf-8", "replace").split()
        if state.engine_ready and state.committed == job.step_id >= 0 and branches:
            try:
                await self._copy(job, branches)
            except Exception as exc:  # the copy is a shortcut: without it each branch rebuilds from its records
                log.warning("fork of %s: engine copy skipped (%s); branches rebuild on their first step",
                            job.session_id, exc)
        await self._ack(job)

    async def _copy(self, job: InboxEntry, branches: list[str]) -> None:
        executor = self._executor()
        redis, keys = executor.scripts.redis, executor.scripts.keys
        hashes: list[SessionHash | None] = []
        for branch in branches:
            raw: Any = await resolve(redis.hgetall(keys.session(branch)))
            hashes.append(SessionHash.from_fields(raw) if raw else None)
        # Only the parent's own branches (a forged entry naming other sessions copies nothing). No
        # await from here on: a branch whose lane started meanwhile is in _sessions now and skipped
        # (its lane rebuilds it from the records), the others get the engine's copy.
        fresh = [(branch, h) for branch, h in zip(branches, hashes, strict=True)
                 if h is not None and h.forked_from == job.session_id and h.owner == executor.worker_id
                 and h.committed_step_id == job.step_id and not h.closed and branch not in self._sessions]
        if not fresh or not executor.engine.fork_session(job.session_id, [branch for branch, _ in fresh]):
            return
        for branch, h in fresh:
            self._sessions[branch] = SessionState(committed=h.committed_step_id, epoch=h.epoch, engine_ready=True,
                                                  model=h.model)

    async def _ack(self, job: InboxEntry) -> None:
        jobs = self._executor().jobs
        await settled(lambda: jobs.drop_entry(job.entry_id), f"{job.kind} {job.session_id}")
