"""The trainer client: create sessions, submit steps (pipelined), reset, close, status.

    async with FleetClient("redis://127.0.0.1:6379/0") as fleet:
        s = await fleet.create_session(model="reference-world", mode="world_model_env")
        r = await s.step(0, observation=obs, action=act)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from redis.asyncio import Redis

from broker.client.replies import ReplyReader
from broker.client.session import Session, new_id
from broker.redis.aio import resolve
from broker.redis.config import CellConfig
from broker.redis.connect import open_redis
from broker.redis.keys import check_session_id
from broker.redis.layouts import DEFAULT_IDLE_TIMEOUT_S, ReplyEntry, SessionHash, idle_timeout_ms_of
from broker.redis.script_replies import (
    Created,
)
from broker.redis.scripts import Scripts
from schemas.errors import (
    ErrorCode,
    InvalidRequestError,
    error_for,
)
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.messages import Mode, SessionStatus, StepResult, parse_mode
from schemas.wire_fields import as_result_window, as_retention

# The longest blocking read a results consumer may ask for (every wait has a bound).
MAX_BLOCK_MS = 30_000
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_SESSION_CHECK_S = 2.0


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


class FleetClient:
    """Async client of one cell. Use as ``async with FleetClient(url) as fleet``.

    ``url``, ``prefix``, ``cell`` and ``lease_ms`` override the matching values of ``config``
    (default: ``CellConfig()``); None keeps the config's value. ``step_timeout`` bounds every
    step and reset called without a ``timeout`` (None: no bound); while waiting, the client checks
    every ``session_check_s`` that the session still exists and fails the wait with
    ``session_not_found`` once it is gone."""

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str | None = None,
        cell: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        client_id: str | None = None,
        lease_ms: int | None = None,
        reply_ttl_ms: int = 3_600_000,
        reconnect_s: float = 60.0,
        config: CellConfig | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S,
        session_check_s: float = DEFAULT_SESSION_CHECK_S,
    ) -> None:
        self.config = (config or CellConfig()).with_overrides(redis_url=url, prefix=prefix, cell=cell,
                                                              lease_ms=lease_ms)
        self.url = self.config.redis_url
        self.keys = self.config.keys
        self.limits = limits
        self.client_id = client_id or f"client-{new_id()[:12]}"
        self.lease_ms = self.config.lease_ms
        self.reply_ttl_ms = reply_ttl_ms
        self.reconnect_s = reconnect_s
        # A step (or reset) called without a timeout waits this long at most; None: no bound.
        self.step_timeout = _positive_or_none("step_timeout", step_timeout)
        # While waiting, how often to check that the session still exists (broker/client/waiting.py).
        self.session_check_s = _positive_or_none("session_check_s", session_check_s) or DEFAULT_SESSION_CHECK_S
        self._redis: Redis | None = None
        self._scripts: Scripts | None = None
        self._replies: ReplyReader | None = None

    async def __aenter__(self) -> FleetClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        if self._redis is not None:
            return
        self._redis = open_redis(self.url, decode_responses=False)
        await self._redis.ping()
        self._scripts = Scripts(self._redis, self.keys)
        self._replies = ReplyReader(self._redis, self.keys.reply(self.client_id))
        self._replies.start()

    async def aclose(self) -> None:
        if self._replies is not None:
            await self._replies.stop()
        if self._scripts is not None:
            await self._scripts.cancel_pending()
        if self._redis is not None:
            await self._redis.aclose()
        self._redis = self._scripts = self._replies = None

    # ------------------------------------------------------------------ plumbing

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            raise RuntimeError("FleetClient is not connected: use `async with FleetClient(...)`")
        return self._redis

    @property
    def scripts(self) -> Scripts:
        if self._scripts is None:
            raise RuntimeError("FleetClient is not connected: use `async with FleetClient(...)`")
        return self._scripts

    @property
    def replies(self) -> ReplyReader:
        if self._replies is None:
            raise RuntimeError("FleetClient is not connected: use `async with FleetClient(...)`")
        return self._replies

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        model: str,
        mode: str | Mode,
        *,
        session_id: str | None = None,
        retention: str = "full",
        result_window: int = 4,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> Session:
        """Place a new session on the least loaded live worker serving (model, mode).

        ``result_window`` is how many of the latest committed results stay stored for idempotent
        retries of a lost reply. ``idle_timeout_s``: the owner closes the session (freeing its
        capacity) after that long without a step, reset or close. Raises CapacityExhaustedError or
        InvalidRequestError.
        """
        mode = parse_mode(mode)
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("model must be a non-empty string")
        as_retention(retention)
        as_result_window(result_window)
        idle_timeout_ms = idle_timeout_ms_of(idle_timeout_s)
        sid = new_id() if session_id is None else check_session_id(session_id)
        reply = await self.scripts.create(sid, mode.value, model, lease_ms=self.lease_ms, retention=retention,
                                          result_window=result_window, idle_timeout_ms=idle_timeout_ms)
        if not isinstance(reply, Created):
            raise error_for(reply.code, reply.message)
        return Session(self, sid, model=model, mode=mode, owner=reply.owner)

    async def attach(self, session_id: str) -> Session:
        """A handle on an existing session (for example one created by another process)."""
        st = await self.status(check_session_id(session_id))
        return Session(self, session_id, model=st.model, mode=st.mode, owner=st.owner)

    async def status(self, session_id: str) -> SessionStatus:
        raw: Any = await resolve(self.redis.hgetall(self.keys.session(session_id)))
        if not raw:
            raise error_for(ErrorCode.SESSION_NOT_FOUND, f"session {session_id!r} does not exist")
        return SessionHash.from_fields(raw).status(session_id)

    def decode_result(self, reply: ReplyEntry, started: float) -> StepResult:
        """A reply entry as a StepResult, with the current committed id and the client's timing."""
        result = reply.step_result(self.limits)
        total = (time.perf_counter() - started) * 1000.0
        lat = result.latency
        latency = dataclasses.replace(
            lat, total_ms=total, commit_ms=max(0.0, total - lat.queue_ms - lat.engine_ms)
        )
        return dataclasses.replace(result, committed_step_id=max(reply.committed, result.committed_step_id)
                                   if result.ok else reply.committed, latency=latency)
