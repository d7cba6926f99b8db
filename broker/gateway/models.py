"""Request and response bodies of the vLLM-Omni RL rollout API (RFC #3747), field for field.

Field names, defaults and optionality follow ``vllm_omni/entrypoints/openai/protocol/rollout.py``
so an existing client works unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Observation(BaseModel):
    """Single-step robot observation."""

    images: dict[str, list[Any] | str] | None = Field(
        default=None,
        description="Named camera images: nested lists (H, W, 3) of numbers in [0, 255] (floats all within "
                    "[0, 1] are normalized intensities), or base64 strings (PNG/JPEG, or a .npy file of an "
                    "HxWx3 uint8 array).",
    )
    state: list[float] | None = Field(default=None, description="Proprioceptive state vector.")
    prompt: str = Field(default="", description="Optional language conditioning.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Pass-through fields.")


class Action(BaseModel):
    """Executed action for world_model_env conditioning (DROID: 7 joints, 1 gripper)."""

    joint_positions: list[float] | None = Field(default=None, description="Executed joint positions (7).")
    gripper_position: float | list[float] | None = Field(default=None, description="Executed gripper position.")
    extra: dict[str, Any] = Field(default_factory=dict)


class SessionMetadata(BaseModel):
    latency_ms: float
    steps_generated: int
    context_length: int
    committed_step_id: int = Field(
        description="Highest step_id whose context has been atomically committed. "
                    "-1 means no step has been committed yet (fresh or reset session).",
    )
    session_memory_bytes: int | None = None
    uncertainty: float | None = None


class ErrorObject(BaseModel):
    code: str
    message: str
    step_id: int | None = None
    committed_step_id: int = -1


class CreateSessionRequest(BaseModel):
    model: str = Field(description="Served model; 'dreamzero' (any case) names the gateway's DreamZero model.")
    mode: Literal["world_model_env"] = "world_model_env"


class CreateSessionResponse(BaseModel):
    session_id: str
    mode: str
    created_at: float


class RolloutStepRequest(BaseModel):
    step_id: int = Field(ge=0, description="Monotonically increasing per session.")
    observation: Observation
    action: Action = Field(description="Required for world_model_env: executed action that produced this observation.")
    use_session_context: bool = True


class RolloutStepResponse(BaseModel):
    step_id: int
    next_observation: dict[str, Any] | None = Field(
        default=None,
        description="Predicted next observation: video_latent (base64 raw tensor), shape, dtype, encoding.",
    )
    model_metadata: SessionMetadata
    error: ErrorObject | None = None


class ResetSessionResponse(BaseModel):
    session_id: str
    committed_step_id: int


class CloseSessionResponse(BaseModel):
    session_id: str
    closed: bool


class SessionStatusResponse(BaseModel):
    session_id: str
    committed_step_id: int
    context_length: int
    closed: bool


class ErrorInfo(BaseModel):
    """vLLM's error body for HTTP errors (``{"error": {...}}``)."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"]
    model: str
    live_workers: int
