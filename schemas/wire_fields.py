"""Readers of wire fields: each checks one value and raises InvalidRequestError naming the field.

Every message's ``from_wire`` is built from these, so a malformed input fails the same way
(and with the same words) whichever message it arrived in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError
from schemas.limits import MAX_STEP_ID


def as_mapping(value: Any, name: str) -> Mapping[str, Any]:
    if type(value) is dict:  # what msgpack decodes to: no ABC check, several times per step
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{name} must be a map, got {type(value).__name__}")
    return value


def or_default(value: Any, default: Any) -> Any:
    """``value``, or ``default`` when it is None. Not ``value or default``: an ndarray has no truth
    value, and asking for one raises ValueError out of the parser."""
    return default if value is None else value


def as_list(value: Any, name: str, what: str) -> list[Any]:
    """A list, a tuple or a 1-D ndarray (read as the list it stands for)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidRequestError(f"{name} must be a 1-D list of {what}, got shape {list(value.shape)}")
        return value.tolist()  # type: ignore[no-any-return]
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidRequestError(f"{name} must be a list of {what}")
    return list(value)


def is_finite(value: int | float) -> bool:
    """math.isfinite without the OverflowError of an int too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def as_floats(value: Any, name: str, *, count: int | None = None) -> tuple[float, ...]:
    fast = _plain_finite_floats(value)
    if fast is not None and (count is None or len(fast) == count):
        return fast
    out: list[float] = []
    for item in as_list(value, name, "numbers"):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise InvalidRequestError(f"{name} must contain only numbers, got {type(item).__name__}")
        if not is_finite(item):
            raise InvalidRequestError(f"{name} must contain finite numbers")
        out.append(float(item))
    if count is not None and len(out) != count:
        raise InvalidRequestError(f"{name} must have {count} values, got {len(out)}")
    return tuple(out)


_FLOAT_ONLY = {float}


def _plain_finite_floats(value: Any) -> tuple[float, ...] | None:
    """The common case of :func:`as_floats` in a few C calls (it runs on every step, on both sides
    of the wire): a list or tuple of only Python floats whose sum is finite. A NaN or an infinity
    makes the sum NaN or infinite, so a finite sum proves every item finite; anything else (ints,
    ndarrays, a bad item, a sum that overflows) takes the item-by-item path and its messages."""
    if type(value) is not list and type(value) is not tuple:
        return None
    if set(map(type, value)) != _FLOAT_ONLY or not math.isfinite(sum(value)):
        return None
    return tuple(value)


def as_int(value: Any, name: str, *, minimum: int | None = None, maximum: int = 2**63 - 1) -> int:
    """An int within [minimum, maximum]; the default maximum is what msgpack and Redis carry."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__}")
    low = -(2**63) if minimum is None else minimum
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {_short(value)}")
    if value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {_short(value)}")
    return value


def _short(value: int) -> str:
    """An int for a message: a hostile 10**4000 must not become a 4000-digit message."""
    return str(value) if value.bit_length() < 256 else f"an integer of {value.bit_length()} bits"


def as_step_id(value: Any) -> int:
    """A step id: an integer in [0, MAX_STEP_ID] (exact in the Lua scripts, see schemas.limits)."""
    return as_int(value, "step_id", minimum=0, maximum=MAX_STEP_ID)


def as_number(value: Any, name: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
        raise InvalidRequestError(f"{name} must be a finite number")
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be within [{low}, {high}], got {value}")
    return float(value)


def as_extra(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    return dict(as_mapping(value, name))


def check_fields(data: Mapping[str, Any], allowed: AbstractSet[str], name: str) -> None:
    if data.keys() <= allowed:  # the common case, without a set built per call
        return
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


RETENTIONS = ("full", "none")  # and "last:N"
MAX_RESULT_WINDOW = 1 << 20  # results kept per session for idempotent retries; a bound, not a target


def as_retention(value: Any) -> str:
    """``full``, ``none`` or ``last:N`` (N a decimal integer in [0, MAX_STEP_ID]): what a session
    keeps of its step inputs. The worker reads N with int(), so nothing else may pass here."""
    if isinstance(value, str) and (value in RETENTIONS or _is_last_n(value)):
        return value
    raise InvalidRequestError(f"retention must be full, none or last:N (N >= 0), got {value!r:.100}")


def _is_last_n(value: str) -> bool:
    head, _, count = value.partition(":")
    return (head == "last" and 0 < len(count) <= 16 and count.isascii() and count.isdigit()
            and int(count) <= MAX_STEP_ID)


def as_result_window(value: Any) -> int:
    """How many latest committed results a session keeps: an integer in [1, MAX_RESULT_WINDOW]."""
    return as_int(value, "result_window", minimum=1, maximum=MAX_RESULT_WINDOW)
