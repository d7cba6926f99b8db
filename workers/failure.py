"""How a job ends without a commit, and how a job-ending script call survives cancellation.

Every way a job can fail (bad input, engine error after its retries, a lost context, a step out of
order, a malformed inbox entry, a bug) raises one ``StepFailed``; the worker catches it in one
place and publishes it through the report script. The exception carries every decision the report
needs, so no helper has to answer a failure itself and signal "already answered" to its caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from broker.redis.backoff import REDIS_ERRORS, until_redis_answers
from broker.redis.inbox import BadEntry, InboxEntry
from schemas.errors import ErrorCode, Fenced, FleetError
from workers.rate_limit import WarningLimiter

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


async def reject_malformed(job: BadEntry, warnings: WarningLimiter) -> None:
    """A malformed entry fails like any job: dead-lettered, and answered if it names where to."""
    warnings.warning("malformed job %s: %s", job.entry_id, job.reason)
    raise StepFailed(ErrorCode.INVALID_REQUEST, f"malformed job: {job.reason}", fallback=False, dead_letter=True)


async def as_step_failure(job: InboxEntry | BadEntry, coro: Any) -> None:
    """Run a job; a bug becomes an ``internal worker error`` failure like any other."""
    try:
        await coro
    except (StepFailed, Fenced, *REDIS_ERRORS):
        raise
    except Exception as exc:
        log.exception("job %s of session %s failed unexpectedly", job.job_id, job.session_id)
        raise StepFailed(ErrorCode.INFERENCE_ERROR, "internal worker error",
                         fallback=True) from exc
