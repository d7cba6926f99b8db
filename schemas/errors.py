"""The closed set of error codes on the wire, and the project's one error tree.

Every ``ErrorCode`` has its class (``error_for`` maps each code to it). The classes after the
wire-code ones are raised inside the fleet (engines, workers, the trainer-side renderer); a
trainer only ever sees their code.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Every error a trainer can see. Defined once; the wire carries the string value."""

    SESSION_NOT_FOUND = "session_not_found"
    SESSION_CLOSED = "session_closed"
    STEP_ALREADY_COMMITTED = "step_already_committed"
    STEP_OUT_OF_ORDER = "step_out_of_order"
    INVALID_REQUEST = "invalid_request"
    INFERENCE_ERROR = "inference_error"
    CAPACITY_EXHAUSTED = "capacity_exhausted"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    CONTEXT_LOST = "context_lost"
    TIMEOUT = "timeout"
    STALE_POLICY = "stale_policy"
    ADMISSION_CLOSED = "admission_closed"
    TRAINER_CAP_REACHED = "trainer_cap_reached"
    CANCELLED = "cancelled"
    REDIS_UNAVAILABLE = "redis_unavailable"


class FleetError(Exception):
    """Base of every error the project raises on purpose; carries a wire code."""

    code: ErrorCode = ErrorCode.INFERENCE_ERROR

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


# ---------------------------------------------------------------------- one class per wire code


class InvalidRequestError(FleetError):
    """Input that can never succeed: wrong shapes, dtypes, fields. Never retried."""

    code = ErrorCode.INVALID_REQUEST


class PayloadTooLargeError(InvalidRequestError):
    """Input over a configured limit (bytes, elements)."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class SessionNotFoundError(FleetError):
    code = ErrorCode.SESSION_NOT_FOUND


class SessionClosedError(FleetError):
    code = ErrorCode.SESSION_CLOSED


class StepAlreadyCommittedError(FleetError):
    """The step is committed and its stored result is gone: it can neither run again nor be re-sent."""

    code = ErrorCode.STEP_ALREADY_COMMITTED


class StepOutOfOrderError(FleetError):
    """The step is not the session's next one (an earlier step failed or is still missing)."""

    code = ErrorCode.STEP_OUT_OF_ORDER


class CapacityExhaustedError(FleetError):
    code = ErrorCode.CAPACITY_EXHAUSTED


class TrainerCapReachedError(FleetError):
    """``create_session`` refused: the trainer already has as many open sessions in the cell as the
    operator's cap for it allows (``rollout-fleet trainers set-cap``). Close one, or ask for more."""

    code = ErrorCode.TRAINER_CAP_REACHED


class InferenceError(FleetError):
    """The engine failed on valid input (possibly transient)."""

    code = ErrorCode.INFERENCE_ERROR


class ContextLost(FleetError):
    """A session's engine context cannot be (re)built: the engine lost it, or the retained step
    records cannot replay it."""

    code = ErrorCode.CONTEXT_LOST


class FleetTimeoutError(FleetError):
    """No answer in time (a step's result, a Redis outage past the reconnect window)."""

    code = ErrorCode.TIMEOUT


class RedisUnavailableError(FleetError):
    """Redis refused writes (out of memory, persistence failing, a read-only replica, a busy script)
    for longer than the client's reconnect window; the message names the reason. Nothing was
    written: send the same step again once Redis writes again."""

    code = ErrorCode.REDIS_UNAVAILABLE


class StalePolicyError(FleetError):
    """The session's trajectory started on a policy version more than its ``max_staleness`` behind
    the version announced for its model: the trainer drops or resets the trajectory."""

    code = ErrorCode.STALE_POLICY


class AdmissionClosedError(FleetError):
    """A producer's admission bound is reached: no new trajectory until a later version is announced."""

    code = ErrorCode.ADMISSION_CLOSED


class CancelledStepError(FleetError):
    """The session was cancelled (``Session.cancel``) before this step committed: it never will.
    The session goes on from its committed step."""

    code = ErrorCode.CANCELLED


# ---------------------------------------------------------------------- raised inside the fleet


class TransientEngineError(InferenceError):
    """The engine could not run the step now (overload, lost connection, server error): retry."""


class StepAborted(InferenceError):
    """The engine stopped a step part way because the worker asked it to (``abort_running``, for a
    weight update that aborts in-flight steps). Like any failed request it leaves the session's
    context unchanged; the worker runs the step again once the update is done. One the engine
    stopped on its own is an inference error like any other."""


class Fenced(FleetError):
    """This worker no longer owns the session (lease epoch or owner moved on). Never published:
    the session's new owner answers its jobs."""

    code = ErrorCode.INFERENCE_ERROR


class ScriptError(FleetError):
    """A Lua script answered something its wrapper does not know."""

    code = ErrorCode.INFERENCE_ERROR


class RenderError(InvalidRequestError, ValueError):
    """The server could not render the prompt (bad messages, unknown model, server error). Still a
    ValueError, as it was before the error tree held it."""


_BY_CODE: dict[ErrorCode, type[FleetError]] = {
    cls.code: cls
    for cls in (
        SessionNotFoundError, SessionClosedError, StepAlreadyCommittedError, StepOutOfOrderError,
        InvalidRequestError, InferenceError, CapacityExhaustedError, PayloadTooLargeError, ContextLost,
        FleetTimeoutError, RedisUnavailableError, StalePolicyError, AdmissionClosedError, TrainerCapReachedError,
        CancelledStepError,
    )
}


def error_for(code: ErrorCode, message: str) -> FleetError:
    """The exception of a wire code (for APIs that raise instead of returning)."""
    return _BY_CODE[code](message)
