"""Typed wire messages: step inputs for both modes, step results, session status.

Every message has ``to_wire()`` (a plain dict with explicit field names, ready for the codec)
and ``from_wire()`` (validates and raises InvalidRequestError with a precise message). This is
the contract's front door: the messages live in ``world_messages`` (world-model steps),
``token_messages`` (token steps) and ``results`` (step results), and every name is importable
from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.errors import InvalidRequestError
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.results import WIRE_VERSION, ErrorInfo, Latency, StepResult
from schemas.token_messages import SamplingParams, TokenStep
from schemas.world_messages import GRIPPER_COUNT, JOINT_COUNT, Action, Observation, WorldStep

__all__ = [
    "GRIPPER_COUNT", "JOINT_COUNT", "WIRE_VERSION", "Action", "ErrorInfo", "Latency", "Mode", "Observation",
    "SamplingParams", "SessionStatus", "StepInput", "StepResult", "TokenStep", "WorldStep", "parse_mode",
    "parse_step_input",
]


class Mode(StrEnum):
    WORLD_MODEL_ENV = "world_model_env"
    TOKENS = "tokens"


def parse_mode(value: Any) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise InvalidRequestError(f"unknown mode {value!r}; expected one of: {allowed}") from None


StepInput = WorldStep | TokenStep


def parse_step_input(mode: Mode, data: Any, limits: Limits = DEFAULT_LIMITS) -> StepInput:
    if mode is Mode.WORLD_MODEL_ENV:
        return WorldStep.from_wire(data, limits)
    return TokenStep.from_wire(data, limits)


@dataclass(frozen=True)
class SessionStatus:
    session_id: str
    mode: Mode
    model: str
    committed_step_id: int
    next_step_id: int
    context_length: int
    closed: bool
    owner: str
    epoch: int
    retention: str = "full"
