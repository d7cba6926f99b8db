"""Typed wire messages: step inputs for both modes, step results, session status.

Every message has ``to_wire()`` (a plain dict with explicit field names, ready for the codec)
and ``from_wire()`` (validates and raises InvalidRequestError with a precise message).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from schemas.errors import ErrorCode, InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits

WIRE_VERSION = 1
JOINT_COUNT = 7  # DROID arm joints
GRIPPER_COUNT = 1


class Mode(StrEnum):
    WORLD_MODEL_ENV = "world_model_env"
    TOKENS = "tokens"


def parse_mode(value: Any) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        allowed = ", ".join(m.value for m in Mode)
        raise InvalidRequestError(f"unknown mode {value!r}; expected one of: {allowed}") from None


# --------------------------------------------------------------------------- validation helpers


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{name} must be a map, got {type(value).__name__}")
    return value


def _floats(value: Any, name: str, *, count: int | None = None) -> tuple[float, ...]:
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidRequestError(f"{name} must be a list of numbers")
    out: list[float] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise InvalidRequestError(f"{name} must contain only numbers, got {type(item).__name__}")
        if not math.isfinite(item):
            raise InvalidRequestError(f"{name} must contain finite numbers")
        out.append(float(item))
    if count is not None and len(out) != count:
        raise InvalidRequestError(f"{name} must have {count} values, got {len(out)}")
    return tuple(out)


def _int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    return value


def _number(value: Any, name: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number")
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be within [{low}, {high}], got {value}")
    return float(value)


def _extra(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    return dict(_mapping(value, name))


def _check_fields(data: Mapping[str, Any], allowed: set[str], name: str) -> None:
    unknown = set(data) - allowed
    if unknown:
        raise InvalidRequestError(f"{name} has unknown fields: {', '.join(sorted(unknown))}")


def _image(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(f"image {name!r} must be a uint8 ndarray, got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise InvalidRequestError(f"image {name!r} must be uint8, got {value.dtype}")
    if value.ndim != 3 or value.shape[2] != 3 or value.shape[0] == 0 or value.shape[1] == 0:
        raise InvalidRequestError(f"image {name!r} must be HxWx3, got shape {list(value.shape)}")
    return value


# --------------------------------------------------------------------------- world-model step


@dataclass(frozen=True)
class Observation:
    """What the environment saw: the DROID layout of the vLLM-Omni rollout API."""

    prompt: str = ""
    images: Mapping[str, np.ndarray] = field(default_factory=dict)
    state: tuple[float, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> Observation:
        data = _mapping(data, "observation")
        _check_fields(data, {"prompt", "images", "state", "extra"}, "observation")
        prompt = data.get("prompt", "")
        if not isinstance(prompt, str):
            raise InvalidRequestError("observation.prompt must be a string")
        images_in = _mapping(data.get("images") or {}, "observation.images")
        if len(images_in) > limits.max_images:
            raise PayloadTooLargeError(f"{len(images_in)} images; limit is {limits.max_images}")
        images = {str(k): _image(v, str(k)) for k, v in images_in.items()}
        state = _floats(data.get("state") or (), "observation.state")
        return cls(prompt=prompt, images=images, state=state, extra=_extra(data.get("extra"), "extra"))

    def to_wire(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "images": dict(self.images), "state": list(self.state),
                "extra": dict(self.extra)}


@dataclass(frozen=True)
class Action:
    """The commanded action: 7 joint positions and 1 gripper position (DROID)."""

    joint_positions: tuple[float, ...] | None = None
    gripper_position: tuple[float, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any) -> Action:
        data = _mapping(data, "action")
        _check_fields(data, {"joint_positions", "gripper_position", "extra"}, "action")
        joints = data.get("joint_positions")
        gripper = data.get("gripper_position")
        return cls(
            joint_positions=None if joints is None else _floats(joints, "joint_positions", count=JOINT_COUNT),
            gripper_position=None
            if gripper is None
            else _floats(gripper, "gripper_position", count=GRIPPER_COUNT),
            extra=_extra(data.get("extra"), "action.extra"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "joint_positions": None if self.joint_positions is None else list(self.joint_positions),
            "gripper_position": None if self.gripper_position is None else list(self.gripper_position),
            "extra": dict(self.extra),
        }


@dataclass(frozen=True)
class WorldStep:
    """Input of one world-model step. Joints/gripper fall back to ``observation.state``."""

    observation: Observation
    action: Action | None = None

    def robot_state(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(7 joint positions, 1 gripper position) as the DROID mapping of the reference picks them."""
        joints = self.action.joint_positions if self.action else None
        gripper = self.action.gripper_position if self.action else None
        state = self.observation.state
        if joints is None and state:
            if len(state) < JOINT_COUNT:
                raise InvalidRequestError(
                    f"observation.state must hold at least 7 joint values, got {len(state)}"
                )
            joints = state[:JOINT_COUNT]
            if gripper is None and len(state) > JOINT_COUNT:
                gripper = state[JOINT_COUNT : JOINT_COUNT + GRIPPER_COUNT]
        return joints or (0.0,) * JOINT_COUNT, gripper or (0.0,) * GRIPPER_COUNT

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> WorldStep:
        data = _mapping(data, "world step")
        _check_fields(data, {"observation", "action"}, "world step")
        if "observation" not in data:
            raise InvalidRequestError("world step needs an observation")
        action = data.get("action")
        step = cls(Observation.from_wire(data["observation"], limits),
                   None if action is None else Action.from_wire(action))
        step.robot_state()  # validates the state fallback early
        return step

    def to_wire(self) -> dict[str, Any]:
        return {"observation": self.observation.to_wire(),
                "action": None if self.action is None else self.action.to_wire()}


# --------------------------------------------------------------------------- token step


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one token step. ``top_k <= 0`` and ``top_p == 1`` disable those filters;
    ``temperature == 0`` is greedy. ``seed`` None means the engine's fixed default seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_wire(cls, data: Any) -> SamplingParams:
        data = _mapping(data or {}, "sampling")
        _check_fields(data, {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"},
                      "sampling")
        seed = data.get("seed")
        stops = data.get("stop_token_ids") or ()
        if not isinstance(stops, (list, tuple)):
            raise InvalidRequestError("sampling.stop_token_ids must be a list of integers")
        return cls(
            max_tokens=_int(data.get("max_tokens", 16), "sampling.max_tokens", minimum=0),
            temperature=_number(data.get("temperature", 1.0), "sampling.temperature", low=0.0, high=100.0),
            top_p=_number(data.get("top_p", 1.0), "sampling.top_p", low=0.0, high=1.0),
            top_k=_int(data.get("top_k", 0), "sampling.top_k"),
            seed=None if seed is None else _int(seed, "sampling.seed", minimum=0),
            stop_token_ids=tuple(_int(t, "sampling.stop_token_ids[]", minimum=0) for t in stops),
        )

    def to_wire(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids)}


@dataclass(frozen=True)
class TokenStep:
    """Input of one token step: ids appended to the session's context, then a generation."""

    token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    multimodal: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Any, limits: Limits = DEFAULT_LIMITS) -> TokenStep:
        data = _mapping(data, "token step")
        _check_fields(data, {"token_ids", "sampling", "return_routed_experts", "multimodal"}, "token step")
        ids = data.get("token_ids")
        if isinstance(ids, np.ndarray):
            if ids.dtype.kind not in "iu" or ids.ndim != 1:
                raise InvalidRequestError("token_ids must be a 1-D integer array")
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError("token_ids must be a list of integers")
        if len(ids) > limits.max_token_ids:
            raise PayloadTooLargeError(f"{len(ids)} token ids; limit is {limits.max_token_ids}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidRequestError("token_ids must contain non-negative integers")
        flag = data.get("return_routed_experts", False)
        if not isinstance(flag, bool):
            raise InvalidRequestError("return_routed_experts must be a boolean")
        return cls(token_ids=tuple(ids), sampling=SamplingParams.from_wire(data.get("sampling")),
                   return_routed_experts=flag,
                   multimodal=_extra(data.get("multimodal"), "multimodal"))

    def to_wire(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "sampling": self.sampling.to_wire(),
                "return_routed_experts": self.return_routed_experts, "multimodal": dict(self.multimodal)}


StepInput = WorldStep | TokenStep


def parse_step_input(mode: Mode, data: Any, limits: Limits = DEFAULT_LIMITS) -> StepInput:
    if mode is Mode.WORLD_MODEL_ENV:
        return WorldStep.from_wire(data, limits)
    return TokenStep.from_wire(data, limits)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message}

    @classmethod
    def from_wire(cls, data: Any) -> ErrorInfo:
        data = _mapping(data, "error")
        try:
            code = ErrorCode(data.get("code"))
        except ValueError as exc:
            raise InvalidRequestError(f"unknown error code {data.get('code')!r}") from exc
        return cls(code=code, message=str(data.get("message", "")))


@dataclass(frozen=True)
class Latency:
    """Where a step's time went, in ms. ``commit_ms`` is commit plus reply transport
    (the client's round trip minus queue and engine time); 0 until the client fills it in."""

    queue_ms: float = 0.0
    engine_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0

    def to_wire(self) -> dict[str, float]:
        return {"queue_ms": self.queue_ms, "engine_ms": self.engine_ms,
                "commit_ms": self.commit_ms, "total_ms": self.total_ms}

    @classmethod
    def from_wire(cls, data: Any) -> Latency:
        data = _mapping(data or {}, "latency")
        return cls(**{k: float(data.get(k, 0.0)) for k in ("queue_ms", "engine_ms", "commit_ms", "total_ms")})


@dataclass(frozen=True)
class StepResult:
    """Answer to one step: ``ok`` with ``output``, or ``error``; always ``committed_step_id``."""

    session_id: str
    step_id: int
    ok: bool
    committed_step_id: int
    output: Mapping[str, Any] | None = None
    error: ErrorInfo | None = None
    context_length: int = 0
    latency: Latency = field(default_factory=Latency)
    worker_id: str = ""
    attempt: int = 0
    policy_version: int = 0
    duplicate: bool = False  # a re-sent, already committed step answered from the stored result

    @classmethod
    def failure(cls, session_id: str, step_id: int, code: ErrorCode, message: str, *,
                committed_step_id: int = -1, context_length: int = 0, worker_id: str = "",
                attempt: int = 0, policy_version: int = 0) -> StepResult:
        return cls(session_id=session_id, step_id=step_id, ok=False, committed_step_id=committed_step_id,
                   error=ErrorInfo(code, message), context_length=context_length, worker_id=worker_id,
                   attempt=attempt, policy_version=policy_version)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "session_id": self.session_id,
            "step_id": self.step_id,
            "ok": self.ok,
            "committed_step_id": self.committed_step_id,
            "output": None if self.output is None else dict(self.output),
            "error": None if self.error is None else self.error.to_wire(),
            "context_length": self.context_length,
            "latency": self.latency.to_wire(),
            "worker_id": self.worker_id,
            "attempt": self.attempt,
            "policy_version": self.policy_version,
            "duplicate": self.duplicate,
        }

    @classmethod
    def from_wire(cls, data: Any) -> StepResult:
        data = _mapping(data, "step result")
        try:
            error = data.get("error")
            return cls(
                session_id=str(data["session_id"]),
                step_id=int(data["step_id"]),
                ok=bool(data["ok"]),
                committed_step_id=int(data["committed_step_id"]),
                output=data.get("output"),
                error=None if error is None else ErrorInfo.from_wire(error),
                context_length=int(data.get("context_length", 0)),
                latency=Latency.from_wire(data.get("latency")),
                worker_id=str(data.get("worker_id", "")),
                attempt=int(data.get("attempt", 0)),
                policy_version=int(data.get("policy_version", 0)),
                duplicate=bool(data.get("duplicate", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"malformed step result: {exc}") from exc


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
