"""The vLLM-Omni-compatible HTTP rollout API in front of the fleet (needs the ``gateway`` extra).

The app is imported on first use, so that the CLI reads :mod:`broker.gateway.settings` without
FastAPI installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.gateway.app import create_app, serve
    from broker.gateway.settings import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from broker.gateway import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
