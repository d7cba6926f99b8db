"""Inbox entries as typed jobs. A malformed entry becomes a BadJob, never a crash."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import Mode


@dataclass(frozen=True)
class Job:
    entry_id: str
    kind: str  # step | reset | close
    job_id: str
    session_id: str
    step_id: int
    contextual: bool
    epoch: int
    gen: int
    mode: Mode
    model: str
    reply_to: str
    enqueued_ms: int
    attempt: int
    payload: bytes
    retention: str = "full"
    min_version: int = 0  # the step waits until the worker's policy version reaches it

    def dead_letter_fields(self, reason: str, attempts: int, worker_id: str, failed_ms: int) -> dict[str, object]:
        """Everything a replay needs, plus why and how often it failed."""
        return {
            "reason": reason, "attempts": attempts, "worker_id": worker_id, "failed_ms": failed_ms,
            "kind": self.kind, "job_id": self.job_id, "session_id": self.session_id, "step_id": self.step_id,
            "contextual": "1" if self.contextual else "0", "mode": self.mode.value, "model": self.model,
            "reply_to": self.reply_to, "enqueued_ms": self.enqueued_ms, "payload": self.payload,
            "min_version": self.min_version,
        }


@dataclass(frozen=True)
class BadJob:
    """An entry that does not parse; answered if it names where to answer."""

    entry_id: str
    reason: str
    session_id: str | None
    job_id: str | None
    reply_to: str | None
    fields: dict[bytes, bytes]


KINDS = frozenset({"step", "reset", "close"})


def _text(fields: dict[bytes, bytes], name: str) -> str:
    value = fields.get(name.encode())
    if value is None:
        raise ValueError(f"missing field {name!r}")
    return value.decode("utf-8")


def parse_job(entry_id: bytes | str, fields: dict[bytes, bytes]) -> Job | BadJob:
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    try:
        kind = _text(fields, "kind")
        if kind not in KINDS:
            raise ValueError(f"unknown job kind {kind!r}")
        return Job(
            entry_id=eid,
            kind=kind,
            job_id=_text(fields, "job_id"),
            session_id=_text(fields, "session_id"),
            step_id=int(_text(fields, "step_id")),
            contextual=_text(fields, "contextual") == "1",
            epoch=int(_text(fields, "epoch")),
            gen=int(_text(fields, "gen")),
            mode=Mode(_text(fields, "mode")),
            model=_text(fields, "model"),
            reply_to=_text(fields, "reply_to"),
            enqueued_ms=int(_text(fields, "enqueued_ms")),
            attempt=int(_text(fields, "attempt")),
            payload=fields.get(b"payload", b""),
            retention=fields.get(b"retention", b"full").decode("utf-8"),
            min_version=int(fields.get(b"min_version", b"0")),
        )
    except (ValueError, UnicodeDecodeError) as exc:
        def opt(name: str) -> str | None:
            raw = fields.get(name.encode())
            return raw.decode("utf-8", "replace") if raw is not None else None

        return BadJob(eid, str(exc), opt("session_id"), opt("job_id"), opt("reply_to"), fields)
