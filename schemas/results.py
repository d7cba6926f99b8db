"""Step results: what a worker publishes for one step (output or error) and where its time went."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.errors import ErrorCode, InvalidRequestError
from schemas.records import quick_init
from schemas.wire_fields import as_mapping

WIRE_VERSION = 1


@quick_init
@dataclass(frozen=True)
class ErrorInfo:
    code: ErrorCode
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message}

    @classmethod
    def from_wire(cls, data: Any) -> ErrorInfo:
        data = as_mapping(data, "error")
        try:
            code = ErrorCode(data.get("code"))
        except ValueError as exc:
            raise InvalidRequestError(f"unknown error code {data.get('code')!r}") from exc
        return cls(code=code, message=str(data.get("message", "")))


@quick_init
@dataclass(frozen=True)
class Latency:
    """Where a step's time went, in ms. ``commit_ms`` is commit plus reply transport
    (the client's round trip minus queue and engine time); 0 until the client fills it in."""

    queue_ms: float = 0.0
    engine_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0

    def to_wire(self) -> dict[str, float]:
        return {"queue_ms": self.queue_ms, "engine_ms": self.engine_ms,
                "commit_ms": self.commit_ms, "total_ms": self.total_ms}

    @classmethod
    def from_wire(cls, data: Any) -> Latency:
        data = as_mapping(data or {}, "latency")
        get = data.get
        return cls(float(get("queue_ms", 0.0)), float(get("engine_ms", 0.0)), float(get("commit_ms", 0.0)),
                   float(get("total_ms", 0.0)))


@quick_init
@dataclass(frozen=True)
class StepResult:
    """Answer to one step: ``ok`` with ``output``, or ``error``; always ``committed_step_id``."""

    session_id: str
    step_id: int
    ok: bool
    committed_step_id: int
    output: Mapping[str, Any] | None = None
    error: ErrorInfo | None = None
    context_length: int = 0
    latency: Latency = field(default_factory=Latency)
    worker_id: str = ""
    attempt: int = 0
    policy_version: int = 0
    duplicate: bool = False  # a re-sent, already committed step answered from the stored result

    @classmethod
    def failure(cls, session_id: str, step_id: int, code: ErrorCode, message: str, *,
                committed_step_id: int = -1, context_length: int = 0, worker_id: str = "",
                attempt: int = 0, policy_version: int = 0) -> StepResult:
        return cls(session_id=session_id, step_id=step_id, ok=False, committed_step_id=committed_step_id,
                   error=ErrorInfo(code, message), context_length=context_length, worker_id=worker_id,
                   attempt=attempt, policy_version=policy_version)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "session_id": self.session_id,
            "step_id": self.step_id,
            "ok": self.ok,
            "committed_step_id": self.committed_step_id,
            "output": None if self.output is None else dict(self.output),
            "error": None if self.error is None else self.error.to_wire(),
            "context_length": self.context_length,
            "latency": self.latency.to_wire(),
            "worker_id": self.worker_id,
            "attempt": self.attempt,
            "policy_version": self.policy_version,
            "duplicate": self.duplicate,
        }

    @classmethod
    def from_wire(cls, data: Any, *, committed: int | None = None, total_ms: float | None = None) -> StepResult:
        """The result ``data`` carries. A client reading its reply gives what it knows beside it, and
        the result is built once with it: ``committed``, the session's committed step id the reply
        entry names (a step that failed reports it; one that succeeded the later of it and its own),
        and ``total_ms``, the client's round trip (``commit_ms`` is then what queue and engine time
        leave of it)."""
        data = as_mapping(data, "step result")
        try:
            error = data.get("error")
            ok = bool(data["ok"])
            committed_step_id = int(data["committed_step_id"])
            if committed is not None:
                committed_step_id = max(committed, committed_step_id) if ok else committed
            latency = Latency.from_wire(data.get("latency"))
            if total_ms is not None:
                queue_ms, engine_ms = latency.queue_ms, latency.engine_ms
                latency = Latency(queue_ms, engine_ms, max(0.0, total_ms - queue_ms - engine_ms), total_ms)
            return cls(
                session_id=str(data["session_id"]),
                step_id=int(data["step_id"]),
                ok=ok,
                committed_step_id=committed_step_id,
                output=data.get("output"),
                error=None if error is None else ErrorInfo.from_wire(error),
                context_length=int(data.get("context_length", 0)),
                latency=latency,
                worker_id=str(data.get("worker_id", "")),
                attempt=int(data.get("attempt", 0)),
                policy_version=int(data.get("policy_version", 0)),
                duplicate=bool(data.get("duplicate", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"malformed step result: {exc}") from exc
