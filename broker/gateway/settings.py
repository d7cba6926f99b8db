"""The gateway's own settings: who may call it and how much one call may cost.

Kept apart from the app so that the CLI reads the defaults without importing FastAPI."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

API_KEY_ENV = "ROLLOUT_FLEET_API_KEY"  # comma-separated keys; `--api-key` (repeatable) wins over it
# The model of a session created without one, and the model GET /health needs a live worker for.
# Here rather than in the app so that the CLI's --model reads it without FastAPI.
DEFAULT_MODEL = "reference-world"


def parse_api_keys(values: Iterable[str]) -> frozenset[str]:
    """Keys from flag values or the variable: each value may hold several, comma-separated."""
    return frozenset(key.strip() for value in values for key in value.split(",") if key.strip())


@dataclass(frozen=True)
class GatewaySettings:
    """With ``api_keys`` empty the gateway is open (a trusted network); with keys, every route
    but ``/health`` needs ``Authorization: Bearer <key>`` and a session belongs to its creator's key."""

    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    max_sessions_per_key: int = 64
    # A finite wait: an HTTP client is never left hanging on a step the fleet does not answer.
    step_timeout_s: float = 60.0
    # The largest body read; JSON images are ~4x their raw bytes, so this fits a full-size payload
    # of schemas.limits in base64 or a few camera views as nested lists.
    max_body_bytes: int = 64 * 1024 * 1024
    # Image decodes run in threads so the event loop keeps serving; this bounds their number.
    decode_threads: int = 4
    # Answer a re-sent committed step as the serving layer does (400 step_already_committed) instead
    # of with its stored result (the fleet's extension, X-Rollout-Duplicate: true).
    upstream_errors: bool = False

    def __post_init__(self) -> None:
        for name in ("max_sessions_per_key", "step_timeout_s", "max_body_bytes", "decode_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GatewaySettings.{name} must be positive")
