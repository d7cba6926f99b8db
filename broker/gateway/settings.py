"""The gateway's own settings: how much one call may cost.

Kept apart from the app so that the CLI reads the defaults without importing FastAPI."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    """Bounds on what one HTTP call may make the gateway read, decode and wait for."""

    # A finite wait: an HTTP client is never left hanging on a step the fleet does not answer.
    step_timeout_s: float = 60.0
    # The largest body read; JSON images are ~4x their raw bytes, so this fits a full-size payload
    # of schemas.limits in base64 or a few camera views as nested lists.
    max_body_bytes: int = 64 * 1024 * 1024
    # Image decodes run in threads so the event loop keeps serving; this bounds their number.
    decode_threads: int = 4

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "max_body_bytes", "decode_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GatewaySettings.{name} must be positive")
