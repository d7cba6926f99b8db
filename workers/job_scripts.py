"""The worker's Lua calls that end a job (commit, report, control, malformed entry), one attempt
each, and the only place that reads their replies: each call turns its reply into a small answer
or raises ``Fenced``. Callers retry and shield them through ``workers.failure.settled``."""

from __future__ import annotations

from typing import Any

from broker.redis.connect import atomic_pipeline
from broker.redis.inbox import BadEntry, InboxEntry
from broker.redis.inputs import is_staged
from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import DEAD_LETTER_MAXLEN, ReplyEntry
from broker.redis.script_replies import (
    CancelledCommit,
    Committed,
    Duplicate,
    DuplicateUnstored,
    OutOfOrder,
    StaleOwner,
    Unrequested,
)
from broker.redis.scripts import Scripts
from schemas.codec import encode
from schemas.errors import ErrorCode, Fenced
from schemas.messages import StepResult
from workers.failure import StepFailed
from workers.settings import WorkerSettings

CommitAnswer = Committed | Duplicate | DuplicateUnstored | OutOfOrder | CancelledCommit


class JobScripts:
    """One worker's calls of the job-ending scripts; ``worker_id`` follows re-registrations."""

    def __init__(self, scripts: Scripts, settings: WorkerSettings) -> None:
        self.scripts = scripts
        self.settings = settings
        self.worker_id = settings.worker_id
        self.reply_bounds = settings.reply_bounds()
        self.replica_wait = settings.replica_wait()

    async def commit(self, job: InboxEntry, result: bytes, *, context_length: int, record: bytes = b"",
                     keep_records: int = -1, version: int | None = None) -> tuple[CommitAnswer, int]:
        """Commit ``result`` as the job's step (``result`` empty: only re-publish a stored one), and
        how many replicas have it. With durability async the result goes out with the commit (the
        count is 0: nobody waited); replicated defers it to :meth:`publish_committed`."""
        args: dict[str, Any] = dict(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=result, context_length=context_length, job_id=job.job_id,
            reply_to=job.reply_to, reply_ttl_ms=self.settings.reply_ttl_ms, record=record,
            keep_records=keep_records, reply_bounds=self.reply_bounds, version=version,
            cancels=job.cancels if result else None,  # a re-publish (empty result) is never cancelled
            input_staged=job.input_staged,
        )
        if self.replica_wait is None:
            reply, acked = await self.scripts.commit(**args), 0
        else:
            reply, acked = await self.scripts.commit_and_wait(wait=self.replica_wait, **args)
        if isinstance(reply, StaleOwner):
            raise Fenced(job.session_id)
        return reply, acked

    async def publish_committed(self, job: InboxEntry) -> None:
        """Publish the stored result of the job's committed step and acknowledge the job (after a
        replica confirmed a deferred commit)."""
        reply = await self.scripts.commit(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=b"", context_length=0, job_id=job.job_id, reply_to=job.reply_to,
            reply_ttl_ms=self.settings.reply_ttl_ms, reply_bounds=self.reply_bounds,
        )
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
