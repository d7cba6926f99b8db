"""Worker configuration: one frozen dataclass, built at the edge (CLI) and passed down."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

from schemas.limits import DEFAULT_LIMITS, Limits


def new_worker_id() -> str:
    """A fresh id per process start: a restarted worker is a new incarnation."""
    return f"w-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerSettings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "rf"
    cell: str = "0"
    worker_id: str = field(default_factory=new_worker_id)
    capacity: int = 256  # sessions this worker may own
    heartbeat_ms: int = 1000
    lease_ms: int = 5000
    read_count: int = 256  # entries per XREADGROUP
    block_ms: int = 1000
    max_inflight: int = 4096  # jobs read but not finished (backpressure on the reader)
    batch_wait_ms: float = 0.0  # extra wait to fill a batch; 0 takes what is queued now
    max_attempts: int = 3  # engine attempts per step for transient errors
    retry_backoff_ms: float = 50.0
    reply_ttl_ms: int = 3_600_000
    close_grace_ms: int = 60_000
    drain_timeout_s: float = 30.0
    handover_on_stop: bool = True  # on SIGTERM hand sessions to live workers (no lease wait)
    limits: Limits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        for name in ("capacity", "heartbeat_ms", "lease_ms", "read_count", "max_inflight", "max_attempts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.heartbeat_ms >= self.lease_ms:
            raise ValueError("heartbeat_ms must be shorter than lease_ms")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> WorkerSettings:
        """Build from a flat mapping; unknown keys are an error, not silently ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown worker settings: {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in values.items() if v is not None})
