"""How a job ends: the worker's Lua calls that end it (commit, report, control, malformed entry),
how such a call survives cancellation, the one failure path, replica confirmation of a commit,
and the drop of entries the session fences off.

Every way a job can fail (bad input, engine error after its retries, a lost context, a step out of
order, a malformed inbox entry, a bug) raises one ``StepFailed``; the worker catches it in one
place and publishes it through the report script. The exception carries every decision the report
needs, so no helper has to answer a failure itself and signal "already answered" to its caller.

``JobScripts`` makes one attempt of each call and is the only place that reads their replies: each
call turns its reply into a small answer or raises ``Fenced``. Callers retry and shield them
through ``settled``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from broker.redis.aio import resolve
from broker.redis.backoff import until_redis_answers
from broker.redis.connect import atomic_pipeline
from broker.redis.inbox import BadEntry, InboxEntry
from broker.redis.inputs import is_staged
from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import DEAD_LETTER_MAXLEN, ReplyEntry
from broker.redis.script_replies import (
    CancelledCommit,
    CommitReply,
    Committed,
    Duplicate,
    DuplicateUnstored,
    OutOfOrder,
    StaleOwner,
    Unrequested,
)
from broker.redis.scripts import CommitCall, Scripts
from schemas.codec import encode
from schemas.errors import ErrorCode, Fenced, FleetError
from schemas.messages import StepResult
from workers.rate_limit import WarningLimiter
from workers.result_server import HeldResults
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepFailed(FleetError):
    """A job that ends with an error result: its code and message, and what the report does.

    ``fallback``: next_step_id falls back to committed+1, so the trainer can send the same step_id
    again (False when the step_id itself is wrong: a retry would fail the same way).
    ``dead_letter``: the job also goes to the dead-letter stream, for a replay.
    ``attempt``: how many engine runs the job had (0 when it never reached the engine)."""

    def __init__(self, code: ErrorCode, message: str, *, fallback: bool, dead_letter: bool = False,
                 attempt: int = 0) -> None:
        super().__init__(message, code=code)
        self.fallback = fallback
        self.dead_letter = dead_letter
        self.attempt = attempt

    @classmethod
    def of(cls, error: FleetError, *, fallback: bool = True, dead_letter: bool = False,
           attempt: int = 0) -> StepFailed:
        """The failure that answers ``error`` with its own code and message."""
        return cls(error.code, error.message, fallback=fallback, dead_letter=dead_letter, attempt=attempt)


async def finish_before_cancel(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled meanwhile; the cancellation reaches
    the caller after it. A commit that was sent is read back and its outcome applied here, so a
    cancelled lane or drain never leaves this worker believing a different committed step than
    Redis. Whatever ``work`` raised after the cancellation is dropped: the job stays pending in
    the inbox and its next owner answers it."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.cancelled():
            raise
        await _wait_out(task)
        raise


async def _wait_out(task: asyncio.Future[Any]) -> None:
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            continue  # cancelled again: the call still has to finish first
    if not task.cancelled():
        task.exception()  # retrieved: it is dropped on purpose (see finish_before_cancel)


async def settled(attempt: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
    """A job-ending script call (commit, report, control): retried until Redis answers, each attempt
    shielded by ``finish_before_cancel``. A cancellation stops the retries but never an attempt."""
    def shielded() -> Awaitable[T]:
        return finish_before_cancel(attempt())

    return await until_redis_answers(shielded, what)


async def settled_in_place(attempt: Callable[[], Coroutine[Any, Any, T]], what: str) -> T:
    """:func:`settled` for an attempt whose one wait is a coalesced script call made with
    ``hold_cancel`` (another task sends it, and a cancellation of this one waits for its answer:
    broker/redis/aio.py ``outcome_of``). The attempt runs in this task, without
    ``finish_before_cancel``'s task of its own (7.5% of a worker's instructions per tiny step:
    docs/benchmarks.md, "Instructions per step"); a cancellation held meanwhile is delivered as
    soon as the attempt ended and applied its outcome, and what the attempt raised is then
    dropped, as there."""
    async def attempt_then_cancel() -> T:
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            outcome = await attempt()
        finally:
            if task is not None and task.cancelling() > cancels:  # cancelled during the attempt
                raise asyncio.CancelledError  # it wins over what the attempt raised, as there
        return outcome

    return await until_redis_answers(attempt_then_cancel, what)


async def reject_malformed(job: BadEntry, warnings: WarningLimiter) -> None:
    """A malformed entry fails like any job: dead-lettered, and answered if it names where to."""
    warnings.warning("malformed job %s: %s", job.entry_id, job.reason)
    raise StepFailed(ErrorCode.INVALID_REQUEST, f"malformed job: {job.reason}", fallback=False, dead_letter=True)


CommitAnswer = Committed | Duplicate | DuplicateUnstored | OutOfOrder | CancelledCommit


class JobScripts:
    """One worker's calls of the job-ending scripts; ``worker_id`` follows re-registrations."""

    def __init__(self, scripts: Scripts, settings: WorkerSettings) -> None:
        self.scripts = scripts
        self.settings = settings
        self.worker_id = settings.worker_id
        self.reply_bounds = settings.reply_bounds()
        self.replica_wait = settings.replica_wait()
        # A commit whose only wait is its coalesced script call (no replica WAIT on this task's
        # connection) holds a cancellation until its answer is in: settled_in_place runs it.
        self.commits_in_place = self.replica_wait is None and scripts.coalesce
        # Large results kept for their trainers to fetch directly (workers/result_server.py; None:
        # not served). Only with durability async: replicated publishes a result later, once a
        # replica has it, and the trainer then reads it from Redis.
        self.held: HeldResults | None = None

    async def commit(self, job: InboxEntry, result: bytes, *, context_length: int, record: bytes = b"",
                     keep_records: int = -1, version: int | None = None) -> tuple[CommitAnswer, int]:
        """Commit ``result`` as the job's step (``result`` empty: only re-publish a stored one), and
        how many replicas have it. With durability async the result goes out with the commit (the
        count is 0: nobody waited); replicated defers it to :meth:`publish_committed`."""
        call = CommitCall(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=result, context_length=context_length, job_id=job.job_id,
            reply_to=job.reply_to, reply_ttl_ms=self.settings.reply_ttl_ms, record=record,
            keep_records=keep_records, reply_bounds=self.reply_bounds, version=version,
            cancels=job.cancels if result else None,  # a re-publish (empty result) is never cancelled
            input_staged=job.input_staged,
        )
        if self.replica_wait is not None:
            reply, acked = await self.scripts.commit_and_wait(call, self.replica_wait)
        elif self.held is not None and len(result) >= self.scripts.stage_bytes:
            reply, acked = await self._commit_held(call, self.held), 0
        else:
            reply, acked = await self.scripts.commit(call, hold_cancel=self.commits_in_place), 0
        if isinstance(reply, StaleOwner):
            raise Fenced(job.session_id)
        return reply, acked

    async def _commit_held(self, call: CommitCall, held: HeldResults) -> CommitReply:
        """The commit of a large result that this worker also hands to its trainer: held before the
        call is sent (the reply may reach the trainer before the answer reaches us), kept only when
        the answer is ``committed``; an error or a cancellation drops it (the trainer reads Redis)."""
        held.hold(call.job_id, call.result)
        committed = False
        try:
            reply = await self.scripts.commit(call, hold_cancel=self.commits_in_place)
            committed = isinstance(reply, Committed)
            return reply
        finally:
            held.settle(call.job_id, committed=committed)

    async def publish_committed(self, job: InboxEntry) -> None:
        """Publish the stored result of the job's committed step and acknowledge the job (after a
        replica confirmed a deferred commit)."""
        reply = await self.scripts.commit(CommitCall(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=b"", context_length=0, job_id=job.job_id, reply_to=job.reply_to,
            reply_ttl_ms=self.settings.reply_ttl_ms, reply_bounds=self.reply_bounds,
        ))
        if isinstance(reply, StaleOwner):
            raise Fenced(job.session_id)
        if not isinstance(reply, Duplicate):  # confirmed on this master a moment ago: only a failover gets here
            raise StepFailed(ErrorCode.STEP_OUT_OF_ORDER, f"step {job.step_id} is no longer committed "
                             "(Redis failed over); send it again", fallback=True)

    async def report(self, job: InboxEntry, result: bytes, *, fallback: bool,
                     dead_letter: dict[str, object] | None) -> None:
        """Publish a result that commits nothing; ``fallback`` lets the trainer retry the step."""
        reply = await self.scripts.report(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, entry_id=job.entry_id,
            job_id=job.job_id, result=result, fallback_gen=job.gen if fallback else None,
            reply_to=job.reply_to, reply_ttl_ms=self.settings.reply_ttl_ms, dead_letter=dead_letter,
            reply_bounds=self.reply_bounds,
        )
        if isinstance(reply, StaleOwner):
            raise Fenced(job.session_id)

    async def apply_control(self, job: InboxEntry) -> None:
        """Apply a reset or close job and answer it."""
        reply = await self.scripts.apply_control(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, entry_id=job.entry_id,
            job_id=job.job_id, kind=job.kind, mode=job.mode.value, model=job.model, reply_to=job.reply_to,
            grace_ms=self.settings.close_grace_ms, reply_ttl_ms=self.settings.reply_ttl_ms,
            closed_retention_ms=round(self.settings.closed_retention_hours * 3_600_000),
            reply_bounds=self.reply_bounds,
        )
        if isinstance(reply, StaleOwner | Unrequested):  # not the session's to apply: dropped as fenced
            raise Fenced(job.session_id)

    async def drop_entry(self, entry_id: str) -> None:
        """Acknowledge and delete an inbox entry that can never run here (fenced by the session)."""
        inbox = self.scripts.keys.inbox(self.worker_id)
        async with atomic_pipeline(self.scripts.redis) as pipe:
            pipe.xack(inbox, INBOX_GROUP, entry_id)
            pipe.xdel(inbox, entry_id)
            await pipe.execute()

    async def reject_malformed(self, job: BadEntry, failure: StepFailed) -> None:
        """Dead-letter an entry that does not parse and answer whoever it names. Not the report
        script: a malformed entry has no epoch to fence on, and maybe nobody to answer."""
        redis, keys = self.scripts.redis, self.scripts.keys
        inbox = keys.inbox(self.worker_id)
        async with atomic_pipeline(redis) as pipe:
            pipe.xadd(keys.dead, job.dead_letter(self.worker_id).to_fields(),
                      maxlen=DEAD_LETTER_MAXLEN, approximate=True)
            pipe.xack(inbox, INBOX_GROUP, job.entry_id)
            pipe.xdel(inbox, job.entry_id)
            if job.session_id and job.job_id and is_staged(job.fields.get(b"payload", b"")):
                # Its input blob goes with it: nothing else would ever read or delete it (a
                # malformed entry cannot be replayed, and failover copies entries as they are).
                pipe.delete(keys.input_blob(job.session_id, job.job_id))
            if job.reply_to and job.job_id:
                result = StepResult.failure(job.session_id or "", -1, failure.code, failure.message,
                                            worker_id=self.worker_id)
                reply = keys.reply(job.reply_to)
                pipe.xadd(reply, ReplyEntry("step", job.job_id, -1, encode(result.to_wire())).to_fields())
                pipe.pexpire(reply, self.settings.reply_ttl_ms)
            await pipe.execute()


# ------------------------------------------------------------------ replicated durability
# Replicated durability on the worker: a committed step is published only once a replica has it.
#
# With ``durability="replicated"`` the commit script writes the commit but keeps the job pending and
# publishes nothing (broker/redis/lua/commit.lua, "deferred"); ``WAIT`` on the same connection says
# how many replicas have it. Until enough do, the worker sends the same commit again (each time
# with a WAIT): on the master that still holds it the repeat is a duplicate that only re-confirms,
# and on a replica promoted before it saw the commit the repeat writes it again (the fence of
# committed_step_id makes that the one commit). Once confirmed, the stored result is published and
# the job acknowledged. Past ``durability_timeout_s`` the step answers ``timeout`` instead: the
# trainer is never told "committed" about a commit no replica has, and a re-send of the step is
# queued for the owner (enqueue.lua), which answers it the same way once a replica is back.

CommitAgain = Callable[[], Coroutine[Any, Any, tuple[CommitAnswer, int]]]


class ReplicaConfirmation:
    """Publishes a job's commit once ``durability_replicas`` replicas have it (no-op when async)."""

    def __init__(self, jobs: JobScripts, settings: WorkerSettings) -> None:
        self.jobs = jobs
        self.wait = settings.replica_wait()
        self.timeout_s = settings.durability_timeout_s
        self._warnings = WarningLimiter(log)  # a replica down for a while: one warning per step otherwise

    async def confirm(self, job: InboxEntry, acked: int, commit_again: CommitAgain) -> None:
        """Publish the job's committed result once enough replicas acknowledged it; ``acked``: how
        many did after the commit, ``commit_again``: the same commit (deferred, with its WAIT)."""
        if self.wait is None:
            return
        deadline = time.monotonic() + self.timeout_s
        what = f"confirm {job.session_id}/{job.step_id}"
        while acked < self.wait.replicas:
            if time.monotonic() >= deadline:
                raise StepFailed(
                    ErrorCode.TIMEOUT,
                    f"step {job.step_id} was written on the Redis master but {acked} of {self.wait.replicas} "
                    f"replicas confirmed it within {self.timeout_s:g}s (durability=replicated), so it is not "
                    "reported as committed: send the same step_id again to get its result once a replica has it",
                    fallback=False)
            self._warnings.warning("%s: %d of %d replicas have it; waiting", what, acked, self.wait.replicas)
            answer, acked = await settled(commit_again, what)
            if not isinstance(answer, Committed | Duplicate):  # the master lost more than this step
                raise StepFailed(ErrorCode.STEP_OUT_OF_ORDER, f"step {job.step_id} could not be committed again "
                                 "after a Redis failover; send the steps again from the first missing one",
                                 fallback=True)
        await settled(lambda: self.jobs.publish_committed(job), f"publish {job.session_id}/{job.step_id}")


# ------------------------------------------------------------------ fenced entries
# Inbox entries the session hash fences off: a job whose epoch (or whose inbox's owner) is not the
# session's. Such an entry can never run or commit here, so it is acknowledged and dropped at once
# (left pending, it would be read again after every reconnect). The session's context is dropped
# only when Redis says this worker no longer holds it at the epoch it runs it under: a forged or
# stale entry leaves a live session alone (no context drop, no rebuild).


class FencedEntries:
    def __init__(self, jobs: JobScripts) -> None:
        self.jobs = jobs
        self.dropped = 0
        self._warn = WarningLimiter(log)

    async def drop(self, job: InboxEntry, held_epoch: int | None) -> bool:
        """Ack and drop the fenced ``job``; True when this worker still holds the session at
        ``held_epoch`` (None: it holds no state of it) and must keep its context."""
        await settled(lambda: self.jobs.drop_entry(job.entry_id), f"drop fenced {job.entry_id}")
        self.dropped += 1
        keep = held_epoch is not None and await self._holds(job.session_id, held_epoch)
        self._warn.warning("dropped fenced entry %s (%s of session %s at epoch %d)%s", job.entry_id, job.kind,
                           job.session_id, job.epoch, "" if keep else "; the session is no longer ours")
        return keep

    async def _holds(self, session_id: str, epoch: int) -> bool:
        redis, keys = self.jobs.scripts.redis, self.jobs.scripts.keys
        raw: Any = await until_redis_answers(
            lambda: resolve(redis.hmget(keys.session(session_id), ["owner", "epoch"])), "session owner")
        return bool(raw[0] == self.jobs.worker_id.encode() and raw[1] == str(epoch).encode())
