"""Between the HTTP bodies of the rollout API and the fleet's step inputs and results.

Images arrive as nested lists (H, W, 3) or base64 strings and leave as validated uint8 arrays; a
``video_latent`` leaves as the reference's ``base64_raw_tensor`` (raw little-endian bytes plus
shape and dtype). Anything malformed is an ``InvalidRequestError``: ``invalid_request`` on the wire.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from broker.gateway.models import Action, ErrorObject, Observation, RolloutStepResponse, SessionMetadata
from schemas.codec import BFloat16Array
from schemas.errors import ErrorCode, InvalidRequestError, PayloadTooLargeError
from schemas.latent_json import encode_latent_json
from schemas.limits import Limits
from schemas.messages import StepResult

_NPY_MAGIC = b"\x93NUMPY"
# Codes the reference answers with an HTTP error status; every other error is HTTP 200 + `error`.
_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.SESSION_CLOSED: 410,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 400,
    ErrorCode.STEP_ALREADY_COMMITTED: 400,
    ErrorCode.STEP_OUT_OF_ORDER: 400,
}


def http_status(result: StepResult) -> int:
    return 200 if result.error is None else _HTTP_STATUS.get(result.error.code, 200)


# --------------------------------------------------------------------------- images


def decode_image(name: str, value: list[Any] | str, limits: Limits) -> np.ndarray:
    """An HxWx3 uint8 array from nested lists of integers in [0, 255] or a base64 string."""
    array = _from_base64(name, value) if isinstance(value, str) else _from_lists(name, value, limits)
    if array.ndim != 3 or array.shape[2] != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidRequestError(f"image {name!r} must be HxWx3, got shape {list(array.shape)}")
    if array.size > limits.max_array_elements:
        raise PayloadTooLargeError(f"image {name!r} has {array.size} elements; limit is {limits.max_array_elements}")
    return np.ascontiguousarray(array, dtype=np.uint8)


def _from_lists(name: str, value: list[Any], limits: Limits) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise InvalidRequestError(f"image {name!r} is not a rectangular HxWx3 list: {exc}") from exc
    if array.size > limits.max_array_elements:
        raise PayloadTooLargeError(f"image {name!r} has {array.size} elements; limit is {limits.max_array_elements}")
    if array.dtype.kind not in "iuf":
        raise InvalidRequestError(f"image {name!r} must hold numbers, got {array.dtype}")
    if array.dtype.kind == "f" and not (np.isfinite(array).all() and (array == np.round(array)).all()):
        raise InvalidRequestError(f"image {name!r} must hold whole numbers in [0, 255]")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise InvalidRequestError(f"image {name!r} values must be within [0, 255]")
    return array.astype(np.uint8)


def _from_base64(name: str, text: str) -> np.ndarray:
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"image {name!r} is not valid base64") from exc
    if raw.startswith(_NPY_MAGIC):
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InvalidRequestError(f"image {name!r} is not a readable .npy array: {exc}") from exc
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
            raise InvalidRequestError(f"image {name!r} (.npy) must be uint8")
        return array
    return _decode_picture(name, raw)


def _decode_picture(name: str, raw: bytes) -> np.ndarray:
    try:
        pil_image: Any = importlib.import_module("PIL.Image")
    except ImportError as exc:
        raise InvalidRequestError(f"image {name!r}: encoded pictures need Pillow on the gateway; "
                                  "send nested lists or a base64 .npy array") from exc
    try:
        with pil_image.open(io.BytesIO(raw)) as picture:
            return np.asarray(picture.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # Pillow raises several types for bad data
        raise InvalidRequestError(f"image {name!r} is not a readable picture: {exc}") from exc


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
