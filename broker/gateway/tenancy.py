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
from broker.redis.keys import DeploymentKeys
from schemas.errors import InvalidRequestError

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
        try:
            key = self._session_key(session_id)
        except InvalidRequestError:
            return  # a malformed id, or one of another cell: the route answers it as for anyone
        stored: bytes | str | None = await resolve(redis.hget(key, OWNER_FIELD))
        if stored == owner.encode() or (stored is None and not await redis.exists(key)):
            return
        raise HTTPException(status_code=403, detail=f"Session {session_id!r} belongs to another API key.")

    async def release(self, owner: str | None, session_id: str) -> None:
        """The session was closed: it no longer counts against its key's cap."""
        if owner is not None:
            await resolve(self.fleet.redis.srem(self._open(owner), session_id))

    async def _admit(self, owner: str) -> None:
        if await self._open_count(owner) >= self.max_sessions:
            await self._prune(owner)
            if await self._open_count(owner) >= self.max_sessions:
                raise self._over_cap()

    async def _open_count(self, owner: str) -> int:
        return int(await resolve(self.fleet.redis.scard(self._open(owner))))

    def _open(self, owner: str) -> str:
        """The key's set of open sessions: in the gateway's cell, or for a gateway of every cell in
        the deployment's keys (its sessions are in many cells)."""
        fleet = self.fleet
        return fleet.keys.gateway_open(owner) if fleet.cell is not None else \
            DeploymentKeys(fleet.config.prefix).gateway_open(owner)

    def _session_key(self, session_id: str) -> str:
        return self.fleet.keys_of(session_id).session(session_id)

    async def _prune(self, owner: str) -> None:
        """Forget the key's sessions that were closed or expired without the gateway's close."""
        redis = self.fleet.redis
        members: set[bytes] = await resolve(redis.smembers(self._open(owner)))
        ids = [member.decode() for member in members]
        async with redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hget(self._session_key(session_id), "closed")
            closed = await pipe.execute()
        gone = [sid for sid, flag in zip(ids, closed, strict=True) if flag is None or flag == b"1"]
        if gone:
            await resolve(redis.srem(self._open(owner), *gone))

    async def _bind(self, owner: str, session_id: str) -> bool:
        """Record the owner and count the session; False (and nothing counted) past the cap."""
        redis, open_key = self.fleet.redis, self._open(owner)
        # The owner first, on its own: the session's key and the open set may be in different slots.
        await resolve(redis.hset(self._session_key(session_id), OWNER_FIELD, owner))
        async with atomic_pipeline(redis) as pipe:
            pipe.sadd(open_key, session_id)
            pipe.scard(open_key)
            _, count = await pipe.execute()
        if int(count) <= self.max_sessions:
            return True
        await resolve(redis.srem(open_key, session_id))
        return False

    def _over_cap(self) -> HTTPException:
        return HTTPException(status_code=429, detail=f"this API key already holds {self.max_sessions} open "
                                                     "sessions; close one first")
