"""Sessions belong to the API key that created them, and each key has a cap on open sessions.

The owner is the key's digest (never the key), stored as a field of the session hash, so it lives
and expires with the session. A per-key set counts the key's open sessions; members whose session
closed or expired are pruned when the key reaches its cap, so the set never outgrows the cap."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import HTTPException

from broker.client import FleetClient, Session
from broker.redis.aio import resolve
from broker.redis.connect import atomic_pipeline

OWNER_FIELD = "gateway_key"  # session hash field: the creating key's digest


class Tenancy:
    """Ownership checks and the per-key session cap. ``owner`` None means an open gateway (no keys):
    nothing is checked or counted."""

    def __init__(self, fleet: FleetClient, max_sessions: int) -> None:
        self.fleet, self.max_sessions = fleet, max_sessions

    async def create(self, owner: str | None, create: Callable[[], Awaitable[Session]]) -> Session:
        """Create a session for ``owner``; 429 when the key already holds its cap of open sessions."""
        if owner is None:
            return await create()
        await self._admit(owner)
        session = await create()
        if not await self._bind(owner, session.session_id):
            # Concurrent creates of one key passed the admission together: the last ones give way.
            await session.close()
            raise self._over_cap()
        return session

    async def check(self, owner: str | None, session_id: str) -> None:
        """403 unless the session belongs to ``owner``; a session that does not exist passes (the
        route answers 404 as for anyone)."""
        if owner is None:
            return
        redis = self.fleet.redis
        key = self.fleet.keys.session(session_id)
        stored: bytes | str | None = await resolve(redis.hget(key, OWNER_FIELD))
        if stored == owner.encode() or (stored is None and not await redis.exists(key)):
            return
        raise HTTPException(status_code=403, detail=f"Session {session_id!r} belongs to another API key.")

    async def release(self, owner: str | None, session_id: str) -> None:
        """The session was closed: it no longer counts against its key's cap."""
        if owner is not None:
            await resolve(self.fleet.redis.srem(self.fleet.keys.gateway_open(owner), session_id))

    async def _admit(self, owner: str) -> None:
        if await self._open_count(owner) >= self.max_sessions:
            await self._prune(owner)
            if await self._open_count(owner) >= self.max_sessions:
                raise self._over_cap()

    async def _open_count(self, owner: str) -> int:
        return int(await resolve(self.fleet.redis.scard(self.fleet.keys.gateway_open(owner))))

    async def _prune(self, owner: str) -> None:
        """Forget the key's sessions that were closed or expired without the gateway's close."""
        redis, keys = self.fleet.redis, self.fleet.keys
        members: set[bytes] = await resolve(redis.smembers(keys.gateway_open(owner)))
        ids = [member.decode() for member in members]
        async with redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hget(keys.session(session_id), "closed")
            closed = await pipe.execute()
        gone = [sid for sid, flag in zip(ids, closed, strict=True) if flag is None or flag == b"1"]
        if gone:
            await resolve(redis.srem(keys.gateway_open(owner), *gone))

    async def _bind(self, owner: str, session_id: str) -> bool:
        """Record the owner and count the session; False (and nothing counted) past the cap."""
        redis, keys = self.fleet.redis, self.fleet.keys
        async with atomic_pipeline(redis) as pipe:
            pipe.hset(keys.session(session_id), OWNER_FIELD, owner)
            pipe.sadd(keys.gateway_open(owner), session_id)
            pipe.scard(keys.gateway_open(owner))
            *_, count = await pipe.execute()
        if int(count) <= self.max_sessions:
            return True
        await resolve(redis.srem(keys.gateway_open(owner), session_id))
        return False

    def _over_cap(self) -> HTTPException:
        return HTTPException(status_code=429, detail=f"this API key already holds {self.max_sessions} open "
                                                     "sessions; close one first")
