"""The vLLM-Omni JSON latent: ``{video_latent, shape, dtype, encoding: "base64_raw_tensor"}``.

``video_latent`` is the array's raw little-endian bytes in base64. The gateway answers with it,
the vLLM-Omni HTTP engine reads it from the server, and the benchmarks' HTTP anchor and transport
comparison do both; this module is the one place that writes and reads it. Decoding checks the
same limits as the msgpack codec (dtype allow-list, dimensions, elements, payload bytes) before
it allocates anything, and any malformed body is an ``InvalidRequestError``.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

from schemas.codec import check_array_header
from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import DEFAULT_LIMITS, Limits

ENCODING = "base64_raw_tensor"


def encode_latent_json(array: np.ndarray) -> dict[str, Any]:
    """The JSON body of one latent (a big-endian or strided array is made little-endian and dense)."""
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # binascii without the trailing newline: the same text as base64.b64encode, with one copy less.
    return {"video_latent": binascii.b2a_base64(array.tobytes(), newline=False).decode("ascii"),
            "shape": list(array.shape), "dtype": str(array.dtype), "encoding": ENCODING}


def decode_latent_json(body: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """The array of a JSON latent body, read-only over the decoded bytes (no second copy)."""
    if body.get("encoding") != ENCODING:
        raise InvalidRequestError(f"unexpected latent encoding {body.get('encoding')!r}")
    text, dtype, shape = _fields(body)
    check_array_header(dtype.name, len(shape), shape, limits)
    # 4 base64 characters carry 3 bytes: the size is known before decoding.
    if len(text) * 3 // 4 > limits.max_payload_bytes:
        raise PayloadTooLargeError(f"latent is about {len(text) * 3 // 4} bytes; limit is {limits.max_payload_bytes}")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error as exc:
        raise InvalidRequestError("video_latent is not valid base64") from exc
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) != count * dtype.itemsize:
        raise InvalidRequestError(f"latent byte length {len(raw)} does not match shape {list(shape)} of {dtype.name}")
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


def _fields(body: Mapping[str, Any]) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
    text, dtype_name, shape = body.get("video_latent"), body.get("dtype"), body.get("shape")
    if not isinstance(text, str) or not isinstance(dtype_name, str) or not isinstance(shape, list | tuple):
        raise InvalidRequestError("a latent needs video_latent (str), dtype (str) and shape (list)")
    if not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape):
        raise InvalidRequestError(f"latent shape must be non-negative integers; got {list(shape)}")
    try:
        dtype = np.dtype(dtype_name).newbyteorder("<")
    except TypeError as exc:
        raise InvalidRequestError(f"unknown latent dtype {dtype_name!r}") from exc
    return text, dtype, tuple(shape)
