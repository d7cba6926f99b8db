"""Inbox entries the session hash fences off: a job whose epoch (or whose inbox's owner) is not the
session's. Such an entry can never run or commit here, so it is acknowledged and dropped at once
(left pending, it would be read again after every reconnect). The session's context is dropped
only when Redis says this worker no longer holds it at the epoch it runs it under: a forged or
stale entry leaves a live session alone (no context drop, no rebuild)."""

from __future__ import annotations

import logging
from typing import Any

from broker.redis.aio import resolve
from broker.redis.backoff import until_redis_answers
from broker.redis.inbox import InboxEntry
from workers.failure import settled
from workers.job_scripts import JobScripts
from workers.rate_limit import WarningLimiter

log = logging.getLogger(__name__)


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
