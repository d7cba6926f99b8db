"""Replicated durability on the worker: a committed step is published only once a replica has it.

With ``durability="replicated"`` the commit script writes the commit but keeps the job pending and
publishes nothing (broker/redis/lua/commit.lua, "deferred"); ``WAIT`` on the same connection says
how many replicas have it. Until enough do, the worker sends the same commit again (each time
with a WAIT): on the master that still holds it the repeat is a duplicate that only re-confirms,
and on a replica promoted before it saw the commit the repeat writes it again (the fence of
committed_step_id makes that the one commit). Once confirmed, the stored result is published and
the job acknowledged. Past ``durability_timeout_s`` the step answers ``timeout`` instead: the
trainer is never told "committed" about a commit no replica has, and a re-send of the step is
queued for the owner (enqueue.lua), which answers it the same way once a replica is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from broker.redis.inbox import InboxEntry
from broker.redis.script_replies import Committed, Duplicate
from schemas.errors import ErrorCode
from workers.failure import StepFailed, settled
from workers.job_scripts import CommitAnswer, JobScripts
from workers.rate_limit import WarningLimiter
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)
CommitCall = Callable[[], Coroutine[Any, Any, tuple[CommitAnswer, int]]]


class ReplicaConfirmation:
    """Publishes a job's commit once ``durability_replicas`` replicas have it (no-op when async)."""

    def __init__(self, jobs: JobScripts, settings: WorkerSettings) -> None:
        self.jobs = jobs
        self.wait = settings.replica_wait()
        self.timeout_s = settings.durability_timeout_s
        self._warnings = WarningLimiter(log)  # a replica down for a while: one warning per step otherwise

    async def confirm(self, job: InboxEntry, acked: int, commit_again: CommitCall) -> None:
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
