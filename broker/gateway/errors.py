"""vLLM's ``{"error": {...}}`` body for every HTTP error the gateway answers itself."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from fastapi.responses import JSONResponse

from broker.gateway.models import ErrorInfo, ErrorResponse


def error_response(status: int, message: str, *, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=HTTPStatus(status).phrase, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)
