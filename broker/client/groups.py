"""Groups and cancel for a session (``Session.fork``, ``Session.cancel``): the calls of fork.lua
and cancel.lua, kept apart from session.py. What each guarantees: docs/async_rl.md."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from broker.redis.keys import CELL_MARK, cell_named_by
from broker.redis.script_replies import Cancelled, Forked, Moved, Refused
from schemas.errors import FleetTimeoutError, InvalidRequestError, error_for

if TYPE_CHECKING:
    from broker.client.session import Session

_Reply = TypeVar("_Reply")
MAX_BRANCHES = 256  # one fork's branches: every branch is a key pair in one atomic script call


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel did: ``cancelled_steps`` (those queued or running; each answers ``cancelled``)
    and the session's committed step and next step id after it (committed + 1; 0 behind a reset)."""

    committed_step_id: int
    next_step_id: int
    cancelled_steps: range


def branch_id(parent_id: str) -> str:
    """A fresh session id in the parent's cell."""
    cell = cell_named_by(parent_id)
    fresh = uuid.uuid4().hex
    return fresh if cell is None else f"{fresh}{CELL_MARK}{cell}"


async def _send(session: Session, call: Callable[[str], Awaitable[_Reply | Moved]]) -> _Reply:
    """The call against the session's owner, following moves (``Session._send``)."""
    reply, _ = await session._send(call)
    if isinstance(reply, Moved):
        raise FleetTimeoutError(f"session {session.session_id} kept moving between workers")
    return reply


async def fork(session: Session, n: int) -> list[str]:
    """Run fork.lua for ``n`` fresh branches: their ids, or the refusal raised as its error."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BRANCHES:
        raise InvalidRequestError(f"fork takes a number of branches in [1, {MAX_BRANCHES}], got {n!r}")
    branches = [branch_id(session.session_id) for _ in range(n)]
    scripts = session.fleet.link(session.cell).scripts
    reply = await _send(session, lambda owner: scripts.fork(
        session.session_id, owner, mode=session.mode.value, model=session.model, branches=branches))
    if isinstance(reply, Refused):
        raise error_for(reply.code, reply.message)
    assert isinstance(reply, Forked)
    return branches


async def cancel(session: Session) -> CancelOutcome:
    """Run cancel.lua; the refusal (session_not_found, session_closed) raised as its error."""
    scripts = session.fleet.link(session.cell).scripts
    reply = await _send(session, lambda owner: scripts.cancel(session.session_id, owner))
    if isinstance(reply, Refused):
        raise error_for(reply.code, reply.message)
    assert isinstance(reply, Cancelled)
    first = reply.committed_step_id + 1
    return CancelOutcome(reply.committed_step_id, reply.next_step_id, range(first, max(first, reply.next_before)))
