"""The worker's half of ``max_staleness`` (docs/async_rl.md). enqueue.lua refuses a step once
the version announced for the session's model passed the trajectory's first version by more than
the bound; a step queued before that announcement is refused here, when its lane picks it up,
and again after the weight gate when the worker's weights changed while it waited there (the
update that made it stale). A refused step commits nothing and falls back like a failed step:
the trainer drops or resets the trajectory."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from broker.redis.backoff import until_redis_answers
from broker.redis.inbox import InboxEntry
from broker.redis.keys import CellKeys
from schemas.errors import ErrorCode
from workers.engines.base import Engine
from workers.failure import StepFailed


def stale_message(first: int, announced: int, model: str, max_staleness: int) -> str | None:
    """Why a step of a trajectory that started on ``first`` is stale, or None (enqueue.lua says
    the same)."""
    if announced <= first + max_staleness:
        return None
    return (f"the trajectory started on policy version {first} and version {announced} of {model} is "
            f"announced, more than max_staleness {max_staleness} ahead: drop the trajectory or reset the session")


class StalenessCheck:
    """Reads the trajectory's first version and the announced one (one round trip) for the steps
    of sessions with a bound; sessions without one cost nothing."""

    def __init__(self, redis: Redis, keys: CellKeys, engine: Engine) -> None:
        self.redis = redis
        self.keys = keys
        self.engine = engine

    async def before_run(self, job: InboxEntry, max_staleness: int | None) -> int:
        """Refuse a stale step (StepFailed ``stale_policy``); the engine's version it checked at."""
        version = self.engine.policy_version_of(job.model)
        if max_staleness is not None:
            await self._check(job, max_staleness)
        return version

    async def in_gate(self, job: InboxEntry, max_staleness: int | None, checked: int, version: int) -> None:
        """After the gate: check again only when the weights changed since ``checked``."""
        if max_staleness is not None and version != checked:
            await self._check(job, max_staleness)

    async def _check(self, job: InboxEntry, max_staleness: int) -> None:
        async def read() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hget(self.keys.session(job.session_id), "first_version")
                pipe.hget(self.keys.announced, job.model)
                return await pipe.execute()

        first, announced = await until_redis_answers(read, f"staleness {job.session_id}")
        if first is None:  # the trajectory has no committed step yet: this one starts it
            return
        why = stale_message(int(first), int(announced or 0), job.model, max_staleness)
        if why is not None:
            raise StepFailed(ErrorCode.STALE_POLICY, why, fallback=True)
