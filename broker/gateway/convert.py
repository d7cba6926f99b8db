"""Between the HTTP bodies of the rollout API and the fleet's step inputs and results.

Images are decoded in :mod:`broker.gateway.images`; a
``video_latent`` leaves as the reference's ``base64_raw_tensor`` (raw little-endian bytes plus
shape and dtype). Anything malformed is an ``InvalidRequestError``: ``invalid_request`` on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from broker.gateway.images import decode_image
from broker.gateway.models import Action, ErrorObject, Observation, RolloutStepResponse, SessionMetadata
from schemas.codec import BFloat16Array
from schemas.errors import ErrorCode, PayloadTooLargeError
from schemas.latent_json import encode_latent_json
from schemas.limits import Limits
from schemas.messages import StepResult

# Codes the reference answers with an HTTP error status; every other error is HTTP 200 + `error`.
_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.SESSION_CLOSED: 410,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.STEP_ALREADY_COMMITTED: 400,
    ErrorCode.STEP_OUT_OF_ORDER: 400,
    # Not the reference's (it has no step timeout): a client that gave up waiting sees a gateway timeout.
    ErrorCode.TIMEOUT: 504,
    # As a create with no room answers: the session lost its worker and no live worker has room.
    ErrorCode.CAPACITY_EXHAUSTED: 503,
    # The trainer already holds as many open sessions as its cap allows: too many requests.
    ErrorCode.TRAINER_CAP_REACHED: 429,
    # Redis refuses writes (out of memory, persistence failing, ...): nothing was written, try again.
    ErrorCode.REDIS_UNAVAILABLE: 503,
}


def http_status(result: StepResult) -> int:
    return 200 if result.error is None else _HTTP_STATUS.get(result.error.code, 200)


# --------------------------------------------------------------------------- step input


def fleet_observation(observation: Observation, limits: Limits) -> dict[str, Any]:
    images = observation.images or {}
    if len(images) > limits.max_images:
        raise PayloadTooLargeError(f"{len(images)} images; limit is {limits.max_images}")
    return {"prompt": observation.prompt,
            "images": {name: decode_image(name, value, limits) for name, value in images.items()},
            "state": list(observation.state or ()),
            "extra": dict(observation.extra)}


def fleet_action(action: Action) -> dict[str, Any]:
    gripper = action.gripper_position
    return {"joint_positions": action.joint_positions,
            "gripper_position": [gripper] if isinstance(gripper, (int, float)) else gripper,
            "extra": dict(action.extra)}


# --------------------------------------------------------------------------- step result


def encode_latent(value: Any) -> dict[str, Any]:
    """The reference's encoding: float tensors as raw bytes (bfloat16 widened to float32, as the
    reference's ``.float()`` does)."""
    return encode_latent_json(value.to_float32() if isinstance(value, BFloat16Array) else np.asarray(value))


def step_response(result: StepResult) -> RolloutStepResponse:
    if result.ok:
        output: Mapping[str, Any] = result.output or {}
        latent = output.get("video_latent")
        return RolloutStepResponse(
            step_id=result.step_id,
            next_observation=None if latent is None else encode_latent(latent),
            model_metadata=SessionMetadata(latency_ms=round(result.latency.total_ms, 2), steps_generated=1,
                                           context_length=result.context_length,
                                           committed_step_id=result.committed_step_id))
    code = result.error.code.value if result.error else ErrorCode.INFERENCE_ERROR.value
    return RolloutStepResponse(
        step_id=result.step_id,
        model_metadata=SessionMetadata(latency_ms=0.0, steps_generated=0, context_length=result.context_length,
                                       committed_step_id=result.committed_step_id),
        error=ErrorObject(code=code, message=result.error.message if result.error else "",
                          step_id=result.step_id, committed_step_id=result.committed_step_id))
