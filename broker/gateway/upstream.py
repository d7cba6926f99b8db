"""Where the fleet's answers and the serving layer's part ways, the gateway's side of closing the gap.

The serving layer answers from one in-process session object, so every answer carries the
session's own ``committed_step_id`` and ``context_length``; the fleet answers a refusal found before
Redis (a bad image) without them, and a stateless step with its throwaway context's length. These
helpers read the session hash once to fill them in. ``--upstream-errors`` also turns the fleet's
re-sent-step extension (the stored result, ``X-Rollout-Duplicate: true``) back into the serving
layer's 400 ``step_already_committed``.
"""

from __future__ import annotations

import dataclasses

from broker.client import FleetClient
from schemas.errors import ErrorCode, FleetError
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
