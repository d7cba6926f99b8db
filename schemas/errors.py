"""The closed set of error codes on the wire, and the project's one error tree."""

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


class CapacityExhaustedError(FleetError):
    code = ErrorCode.CAPACITY_EXHAUSTED


class InferenceError(FleetError):
    """The engine failed on valid input (possibly transient)."""

    code = ErrorCode.INFERENCE_ERROR


_BY_CODE: dict[ErrorCode, type[FleetError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLargeError,
    ErrorCode.SESSION_NOT_FOUND: SessionNotFoundError,
    ErrorCode.SESSION_CLOSED: SessionClosedError,
    ErrorCode.CAPACITY_EXHAUSTED: CapacityExhaustedError,
    ErrorCode.INFERENCE_ERROR: InferenceError,
}


def error_for(code: ErrorCode, message: str) -> FleetError:
    """The most specific exception for a wire code (for APIs that raise instead of returning)."""
    cls = _BY_CODE.get(code, FleetError)
    return cls(message, code=code)
