"""vLLM's ``{"error": {...}}`` body for every HTTP error the gateway answers itself."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from broker.gateway.models import ErrorInfo, ErrorResponse

# A malformed body's answer names its errors, bounded as vLLM bounds them: pydantic reports one
# error per bad element and repeats the offending value in each, so a small body of many bad
# elements would otherwise answer megabytes.
MAX_REPORTED_ERRORS = 10
MAX_INPUT_CHARS = 200
MAX_ERROR_CHARS = 1000
# Segments of a pydantic error location that name a validator or a union branch, not a field:
# dropped from ``param`` as vLLM drops them (``body.observation.images.cam``, not ``...cam.list[any]``).
_BRACKETED = re.compile(r"[\[\]{}()]")
_TYPE_TAGS = frozenset({"function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
                        "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "str", "int",
                        "float", "bool", "bytes", "list", "tuple", "dict", "set", "none"})


def error_response(status: int, message: str, *, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=HTTPStatus(status).phrase, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _summary(value: Any) -> Any:
    """A bounded stand-in for an error's ``input``: containers are described, never rendered."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_INPUT_CHARS] + "...[truncated]" if len(text) > MAX_INPUT_CHARS else value


def validation_message(errors: Sequence[Any]) -> str:
    """``N validation errors:`` and the first few errors, each bounded (vLLM's wording)."""
    if not errors:
        return "Validation error"
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    for err in errors[:MAX_REPORTED_ERRORS]:
        if isinstance(err, dict) and "input" in err:
            err = {**err, "input": _summary(err["input"])}
        text = str(err)
        lines.append("  " + (text[:MAX_ERROR_CHARS] + "...[truncated]" if len(text) > MAX_ERROR_CHARS else text))
    if len(errors) > MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - MAX_REPORTED_ERRORS} more {label}")
    return "\n".join(lines)


def validation_param(loc: Sequence[Any]) -> str | None:
    """The dotted field path of an error location, validator and union-branch segments left out."""
    parts = [str(part) for part in loc if not (_BRACKETED.search(str(part)) or str(part).lower() in _TYPE_TAGS)]
    return ".".join(parts or [str(part) for part in loc]) or None
