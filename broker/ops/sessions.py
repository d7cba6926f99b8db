"""The sessions of a cell, for operators: list (filtered, bounded), show one, close one.

A session's state, from its hash and the cell's session index:
``open`` (not closed), ``closing`` (closed, its owner has not applied the close yet: still in the
index) and ``closed`` (the owner dropped it: a tombstone hash until it expires). A close goes
through the broker's own path (:meth:`broker.client.session.Session.close`: control.lua queues a
close job behind the session's steps), never a key deletion.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from redis.asyncio import Redis

from broker.client.fleet import FleetClient
from broker.redis.aio import resolve
from broker.redis.blobs import resolved
from broker.redis.config import CellConfig
from broker.redis.connect import server_time_ms
from broker.redis.keys import CellKeys, check_session_id
from broker.redis.layouts import LayoutError, SessionHash, log_result_field, log_result_steps
from schemas.codec import decode
from schemas.errors import ErrorCode, error_for
from schemas.limits import DEFAULT_LIMITS
from schemas.results import StepResult

STATES = ("open", "closing", "closed")
SCAN_COUNT = 500  # keys per SCAN call: one call never blocks Redis for long
DEFAULT_LIMIT = 1000


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    state: str
    mode: str
    model: str
    owner: str
    epoch: int
    committed_step_id: int
    next_step_id: int
    idle_ms: int  # Redis now minus the session's last activity (updated_ms, the idle sweep's field)
    idle_timeout_ms: int
    idle_closed: bool
    priority: str = "bulk"  # interactive steps run first on a busy worker
    trainer: str = ""  # whose open-session cap it counts against ("" from before trainers)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SessionDetail(SessionRow):
    gen: int = 0
    context_length: int = 0
    retention: str = "full"
    result_window: int = 1
    created_ms: int = 0
    results: tuple[int, int] | None = None  # stored results, first and last step id
    inputs: tuple[int, int] | None = None  # stored step records (for a context rebuild), first and last
    policy_version: int | None = None  # of the last committed step's stored result


def _state(hashed: SessionHash, indexed: bool) -> str:
    if not hashed.closed:
        return "open"
    return "closing" if indexed else "closed"


def _row(sid: str, h: SessionHash, indexed: bool, now_ms: int) -> dict[str, Any]:
    return {"session_id": sid, "state": _state(h, indexed), "mode": h.mode.value, "model": h.model,
            "owner": h.owner, "epoch": h.epoch, "committed_step_id": h.committed_step_id,
            "next_step_id": h.next_step_id, "idle_ms": max(0, now_ms - h.updated_ms),
            "idle_timeout_ms": h.idle_timeout_ms, "idle_closed": h.idle_closed, "priority": h.priority.value,
            "trainer": h.trainer}


async def _now_ms(redis: Redis, keys: CellKeys) -> int:
    return await server_time_ms(redis, keys.sessions)


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


async def list_sessions(redis: Redis, keys: CellKeys, *, model: str | None = None, owner: str | None = None,
                        state: str | None = None, limit: int = DEFAULT_LIMIT) -> list[SessionRow]:
    """The cell's sessions that match every filter given, at most ``limit`` of them (SCAN in steps
    of SCAN_COUNT keys; a session created or removed meanwhile may be missed or seen)."""
    if state is not None and state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")
    stem = keys.session("")
    now = await _now_ms(redis, keys)
    rows: list[SessionRow] = []
    async for key in redis.scan_iter(match=_glob_escape(stem) + "*", count=SCAN_COUNT):
        sid = (key.decode() if isinstance(key, bytes) else key)[len(stem):]
        raw: Any = await resolve(redis.hgetall(key))
        try:
            hashed = SessionHash.from_fields(raw)
        except LayoutError:
            continue  # expired between SCAN and HGETALL, or not a session hash
        indexed = bool(await resolve(redis.hexists(keys.sessions, sid)))
        row = SessionRow(**_row(sid, hashed, indexed, now))
        wanted = {"model": model, "owner": owner, "state": state}
        if all(value is None or getattr(row, name) == value for name, value in wanted.items()):
            rows.append(row)
            if len(rows) >= limit:
                break
    return sorted(rows, key=lambda r: r.session_id)


def _span(fields: list[bytes], kind: str) -> tuple[int, int] | None:
    steps = [int(f.split(b":", 1)[1]) for f in fields if f.startswith(kind.encode() + b":")]
    return (min(steps), max(steps)) if steps else None


async def show_session(redis: Redis, keys: CellKeys, session_id: str) -> SessionDetail:
    """One session in full; SessionNotFoundError when it does not exist (or its tombstone expired)."""
    sid = check_session_id(session_id)
    raw: Any = await resolve(redis.hgetall(keys.session(sid)))
    if not raw:
        raise error_for(ErrorCode.SESSION_NOT_FOUND, f"session {sid!r} does not exist")
    h = SessionHash.from_fields(raw)
    indexed = bool(await resolve(redis.hexists(keys.sessions, sid)))
    names: Any = await resolve(redis.hkeys(keys.log(sid)))
    version = None
    results = log_result_steps(names, h.committed_step_id, h.result_window)
    if h.committed_step_id in results:
        field = log_result_field(h.committed_step_id, h.result_window)
        if f"result:{h.committed_step_id}".encode() in names:  # a log written before the window's ring
            field = f"result:{h.committed_step_id}"
        stored: Any = await resolve(redis.hget(keys.log(sid), field))
        stored = await resolved(redis, stored) if stored else None  # a blob gone: no version to show
        if stored:
            version = StepResult.from_wire(decode(stored, DEFAULT_LIMITS)).policy_version
    now = await _now_ms(redis, keys)
    return SessionDetail(**_row(sid, h, indexed, now), gen=h.gen, context_length=h.context_length,
                         retention=h.retention, result_window=h.result_window, created_ms=h.created_ms,
                         results=(results[0], results[-1]) if results else None, inputs=_span(names, "input"),
                         policy_version=version)


async def close_session(config: CellConfig, session_id: str) -> SessionDetail:
    """Close a session as its trainer would (a close job behind its queued steps); its state after."""
    async with FleetClient(config=config, step_timeout=None) as fleet:
        session = await fleet.attach(session_id)
        await session.close()
        return await show_session(fleet.redis, fleet.keys, session_id)
