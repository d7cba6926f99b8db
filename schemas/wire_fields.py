"""Readers of wire fields: each checks one value and raises InvalidRequestError naming the field.

Every message's ``from_wire`` is built from these, so a malformed input fails the same way
(and with the same words) whichever message it arrived in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError


def as_mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{name} must be a map, got {type(value).__name__}")
    return value


def as_floats(value: Any, name: str, *, count: int | None = None) -> tuple[float, ...]:
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


def as_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    return value


def as_number(value: Any, name: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number")
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be within [{low}, {high}], got {value}")
    return float(value)


def as_extra(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    return dict(as_mapping(value, name))


def check_fields(data: Mapping[str, Any], allowed: set[str], name: str) -> None:
    unknown = set(data) - allowed
    if unknown:
        raise InvalidRequestError(f"{name} has unknown fields: {', '.join(sorted(unknown))}")


def as_image(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(f"image {name!r} must be a uint8 ndarray, got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise InvalidRequestError(f"image {name!r} must be uint8, got {value.dtype}")
    if value.ndim != 3 or value.shape[2] != 3 or value.shape[0] == 0 or value.shape[1] == 0:
        raise InvalidRequestError(f"image {name!r} must be HxWx3, got shape {list(value.shape)}")
    return value
