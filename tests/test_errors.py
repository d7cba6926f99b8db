"""The error tree: one class per wire code, and the errors raised inside the fleet under FleetError."""

from __future__ import annotations

import pytest

from schemas.errors import (
    ContextLost,
    ErrorCode,
    Fenced,
    FleetError,
    InferenceError,
    InvalidRequestError,
    RenderError,
    ScriptError,
    StepAborted,
    TransientEngineError,
    error_for,
)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_has_its_own_class(code: ErrorCode) -> None:
    error = error_for(code, "why")
    assert error.code is code and type(error).code is code and error.message == "why"
    assert type(error) is not FleetError


def test_each_code_maps_to_a_different_class() -> None:
    assert len({type(error_for(code, "")) for code in ErrorCode}) == len(ErrorCode)


@pytest.mark.parametrize(("cls", "code"), [
    (ContextLost, ErrorCode.CONTEXT_LOST),
    (TransientEngineError, ErrorCode.INFERENCE_ERROR),
    (StepAborted, ErrorCode.INFERENCE_ERROR),
    (Fenced, ErrorCode.INFERENCE_ERROR),
    (ScriptError, ErrorCode.INFERENCE_ERROR),
    (RenderError, ErrorCode.INVALID_REQUEST),
])
def test_errors_raised_inside_the_fleet_carry_their_wire_code(cls: type[FleetError], code: ErrorCode) -> None:
    error = cls("why")
    assert isinstance(error, FleetError) and error.code is code and str(error) == f"{code.value}: why"


def test_engine_failures_are_inference_errors_and_render_errors_stay_value_errors() -> None:
    assert issubclass(TransientEngineError, InferenceError) and issubclass(StepAborted, InferenceError)
    assert issubclass(RenderError, InvalidRequestError) and issubclass(RenderError, ValueError)
