"""Where the fleet's answers and the serving layer's part ways, the gateway's side of closing the gap.

The serving layer answers from one in-process session object, so every answer carries the
session's own ``committed_step_id`` and ``context_length``; the fleet answers a refusal found before
Redis (a bad image) without them, and a stateless step with its throwaway context's length. These
helpers read the session hash once to fill them in. The serving layer also checks a step in its
own order (the session exists and is open, then the step id, then the input), where the gateway
reads the input before it reaches Redis: a refused input is answered with the error the session's
state would have given first. ``--upstream-errors`` also turns the fleet's
re-sent-step extension (the stored result, ``X-Rollout-Duplicate: true``) back into the serving
layer's 400 ``step_already_committed``.
"""

from __future__ import annotations

import dataclasses

from broker.client import FleetClient
from schemas.errors import ErrorCode, FleetError, SessionNotFoundError
from schemas.messages import SessionStatus, StepResult

# The model name the serving layer accepts for any DreamZero checkpoint it serves, case-insensitively.
DREAMZERO = "dreamzero"


def served_model(requested: str, default: str) -> str:
    """The model a create asks the fleet for: ``dreamzero`` in any case names the gateway's own
    model when that is a DreamZero one, as the serving layer's model check does."""
    if requested.lower() == DREAMZERO and DREAMZERO in default.lower():
        return default
    return requested


async def _status(fleet: FleetClient, session_id: str) -> SessionStatus | None:
    try:
        return await fleet.status(session_id)
    except FleetError:  # gone meanwhile: the answer keeps the fleet's values
        return None


async def with_session_values(fleet: FleetClient, result: StepResult) -> StepResult:
    """``result`` with the session's committed step and context length, read from its hash."""
    status = await _status(fleet, result.session_id)
    if status is None:
        return result
    return dataclasses.replace(result, committed_step_id=status.committed_step_id,
                               context_length=status.context_length)


async def as_upstream_duplicate(fleet: FleetClient, result: StepResult) -> StepResult:
    """A re-sent committed step as the serving layer answers it: ``step_already_committed``."""
    status = await _status(fleet, result.session_id)
    committed = status.committed_step_id if status else result.committed_step_id
    return StepResult.failure(
        result.session_id, result.step_id, ErrorCode.STEP_ALREADY_COMMITTED,
        f"Step {result.step_id} is already committed; highest committed step is {committed}.",
        committed_step_id=committed, context_length=status.context_length if status else result.context_length)


async def as_upstream_refusal(fleet: FleetClient, result: StepResult, step_id: int, contextual: bool) -> StepResult:
    """Step ``step_id``, its input refused before Redis, as the serving layer orders its checks:
    an unknown or closed session, then a contextual step id other than ``committed + 1``, and only
    then the input (with the session's values). ``step_id`` is the request's: the client reports an
    id past the fleet's range as -1."""
    result = dataclasses.replace(result, step_id=step_id)
    try:
        status = await fleet.status(result.session_id)
    except SessionNotFoundError:
        return StepResult.failure(result.session_id, result.step_id, ErrorCode.SESSION_NOT_FOUND,
                                  f"Session {result.session_id!r} does not exist.")
    except FleetError:  # unreadable meanwhile: the refusal as the fleet gave it
        return result
    if status.closed:
        return StepResult.failure(result.session_id, result.step_id, ErrorCode.SESSION_CLOSED,
                                  f"Session {result.session_id!r} is closed.")
    committed, length = status.committed_step_id, status.context_length
    if contextual and result.step_id <= committed:
        return StepResult.failure(
            result.session_id, result.step_id, ErrorCode.STEP_ALREADY_COMMITTED,
            f"Step {result.step_id} is already committed; highest committed step is {committed}.",
            committed_step_id=committed, context_length=length)
    if contextual and result.step_id != committed + 1:
        return StepResult.failure(result.session_id, result.step_id, ErrorCode.STEP_OUT_OF_ORDER,
                                  f"Expected step_id {committed + 1}, got {result.step_id}.",
                                  committed_step_id=committed, context_length=length)
    return dataclasses.replace(result, committed_step_id=committed, context_length=length)
