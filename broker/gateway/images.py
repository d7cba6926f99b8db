"""Camera images from HTTP bodies: nested lists (H, W, 3) of integers or floats (as upstream takes
them) or base64 strings (PNG/JPEG, or a .npy file of an HxWx3 uint8 array), each returned as a
validated uint8 array.

Upstream's protocol (``vllm_omni/entrypoints/openai/protocol/rollout.py``, ``images: dict[str, list]``:
"Base64 strings are not accepted in P0") takes nested numeric lists only and answers a string with a
400 validation error; base64 strings are this gateway's extension, so a client whose camera frames
are already PNG/JPEG or numpy buffers need not expand them into JSON lists (about 4x the bytes).

Every path checks the size an input *declares* before allocating for it: a .npy header's shape and
dtype, a picture's header size (Pillow reads it without decoding), so a small hostile body cannot
make the gateway allocate gigabytes or decode for seconds. Errors are ``InvalidRequestError`` or
``PayloadTooLargeError`` (``invalid_request`` / ``payload_too_large`` on the wire)."""

from __future__ import annotations

import base64
import binascii
import importlib
import io
import math
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from schemas.errors import InvalidRequestError, PayloadTooLargeError
from schemas.limits import Limits

_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 10_000  # numpy's own default bound on a header it parses
# Only these decoders are ever tried: Pillow would otherwise probe every format it knows, some of
# which (EPS through Ghostscript, multi-frame TIFF/GIF) cost far more than their header admits.
PICTURE_FORMATS = ("PNG", "JPEG")


def decode_image(name: str, value: list[Any] | str, limits: Limits) -> np.ndarray:
    """An HxWx3 uint8 array from nested lists of numbers in [0, 255] (floats all within [0, 1] are
    normalized intensities) or a base64 string."""
    array = _from_base64(name, value, limits) if isinstance(value, str) else _from_lists(name, value, limits)
    if array.ndim != 3 or array.shape[2] != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidRequestError(f"image {name!r} must be HxWx3, got shape {list(array.shape)}")
    _check_elements(name, array.size, limits)
    return np.ascontiguousarray(array, dtype=np.uint8)


def _check_elements(name: str, elements: int, limits: Limits) -> None:
    if elements > limits.max_array_elements:
        raise PayloadTooLargeError(f"image {name!r} has {elements} elements; limit is {limits.max_array_elements}")


def _from_lists(name: str, value: list[Any], limits: Limits) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise InvalidRequestError(f"image {name!r} is not a rectangular HxWx3 list: {exc}") from exc
    _check_elements(name, array.size, limits)
    if array.dtype.kind not in "iuf":
        raise InvalidRequestError(f"image {name!r} must hold numbers, got {array.dtype}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidRequestError(f"image {name!r} must hold finite numbers")
    if array.size and (array.min() < 0 or array.max() > 255):
        raise InvalidRequestError(f"image {name!r} values must be within [0, 255]")
    if array.dtype.kind == "f":
        return _from_floats(array)
    return array.astype(np.uint8)


def _from_floats(array: np.ndarray) -> np.ndarray:
    """Float pixels, as upstream takes them: all within [0, 1] they are normalized intensities
    (x255), otherwise 0-255 values; either way rounded, since the fleet carries images as uint8."""
    scale = 255.0 if array.size and array.max() <= 1.0 else 1.0
    pixels: np.ndarray = np.rint(array * scale).astype(np.uint8)
    return pixels


def _from_base64(name: str, text: str, limits: Limits) -> np.ndarray:
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"image {name!r} is not valid base64") from exc
    if raw.startswith(_NPY_MAGIC):
        return _from_npy(name, raw, limits)
    return _decode_picture(name, raw, limits)


def _from_npy(name: str, raw: bytes, limits: Limits) -> np.ndarray:
    """A .npy array, its header checked first: uint8, within the element limit, and backed by as
    many bytes as it declares (numpy would otherwise allocate what the header claims)."""
    stream = io.BytesIO(raw)
    try:
        version = npy_format.read_magic(stream)
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(stream, max_header_size=_NPY_MAX_HEADER)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise InvalidRequestError(f"image {name!r} is not a readable .npy array: {exc}") from exc
    if dtype != np.uint8:
        raise InvalidRequestError(f"image {name!r} (.npy) must be uint8, got {dtype}")
    elements = math.prod(shape)
    _check_elements(name, elements, limits)
    data = memoryview(raw)[stream.tell():]
    if len(data) != elements:
        raise InvalidRequestError(f"image {name!r} (.npy) declares shape {list(shape)} but holds {len(data)} bytes")
    array = np.frombuffer(data, dtype=np.uint8)
    return array.reshape(shape, order="F" if fortran_order else "C")


def _decode_picture(name: str, raw: bytes, limits: Limits) -> np.ndarray:
    try:
        pil_image: Any = importlib.import_module("PIL.Image")
    except ImportError as exc:
        raise InvalidRequestError(f"image {name!r}: encoded pictures need Pillow on the gateway; "
                                  "send nested lists or a base64 .npy array") from exc
    try:
        with pil_image.open(io.BytesIO(raw), formats=PICTURE_FORMATS) as picture:
            width, height = picture.size  # from the header: nothing is decoded yet
            _check_elements(name, width * height * 3, limits)
            return np.asarray(picture.convert("RGB"), dtype=np.uint8)
    except PayloadTooLargeError:
        raise
    except Exception as exc:  # Pillow raises several types for bad data
        raise InvalidRequestError(f"image {name!r} is not a readable picture: {exc}") from exc
