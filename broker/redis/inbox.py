"""Inbox entries (``rf:{c}:inbox:<wid>`` STREAM): the jobs a worker runs, written by enqueue.lua
(steps), control.lua (reset, close), cancel.lua and fork.lua, moved whole by failover.lua and dead-lettered whole by
retire.lua. A malformed entry becomes a BadEntry, never a crash.

A step entry comes in two layouts, and a worker of this release reads both. The classic one has a
field per value. The packed one (its layout is :mod:`broker.redis.layouts`' ``PACKED``) keeps
``session_id``, ``epoch``, ``job_id``, ``reply_to`` and ``payload`` as fields of their own and
joins the rest into one field, NUL-separated, the model last (the one part that could hold a
NUL): a master writes, keeps and sends 6 fields a step instead of 13 (docs/sizing.md). enqueue.lua
writes it only to an owner whose worker hash says it reads one (``READS_FIELD``, written by this
release's workers); failover.lua unpacks it when it moves it to an owner that does not, and
retire.lua when it dead-letters it, so an earlier release's worker or replay never meets one. The
fields an earlier release's worker needs to answer an entry it cannot read (``session_id``,
``job_id``, ``reply_to``) and those failover finds and re-stamps (``session_id``, ``epoch``) stay
fields of their own."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from broker.redis.inputs import is_staged
from broker.redis.layouts import PACKED, DeadLetter, Fields, LayoutError, dead_letter_payload, integer, text, unpacked
from schemas.limits import MAX_STEP_ID
from schemas.messages import Mode
from schemas.records import quick_init
from schemas.sharing import DEFAULT_PRIORITY, Priority


class JobKind(StrEnum):
    """What an inbox entry asks of its worker (the entry's ``kind`` field)."""

    STEP = "step"  # enqueue.lua
    RESET = "reset"  # control.lua
    CLOSE = "close"  # control.lua
    CANCEL = "cancel"  # cancel.lua
    FORK = "fork"  # fork.lua


# The lowest step id an entry of a kind may carry (a fork's: the parent's committed step, -1 before
# its first); the other kinds carry -1.
_LOWEST_STEP_ID = {JobKind.STEP: 0, JobKind.FORK: -1}
# Field values as written, for the one-pass read of a well-formed entry.
_KIND_OF = {kind.value.encode(): kind for kind in JobKind}
_MODE_OF = {mode.value.encode(): mode for mode in Mode}
_PRIORITY_OF = {priority.value.encode(): priority for priority in Priority}
_DEFAULT_PRIORITY = DEFAULT_PRIORITY.value.encode()


@quick_init
@dataclass(frozen=True)
class InboxEntry:
    entry_id: str  # its id in the inbox (not a field)
    kind: JobKind
    job_id: str
    session_id: str
    step_id: int  # -1 for reset, close and cancel; a fork's: the parent's committed step it forks from
    contextual: bool
    epoch: int  # the lease epoch it was enqueued under (failover re-stamps it)
    gen: int
    mode: Mode
    model: str
    reply_to: str
    enqueued_ms: int
    attempt: int
    payload: bytes
    retention: str = "full"
    min_version: int = 0  # the step waits until the worker's policy version reaches it
    priority: Priority = DEFAULT_PRIORITY  # the session's class, copied by enqueue.lua (steps only)
    cancels: int = 0  # the session's cancel count when it was enqueued (cancel.lua, commit.lua)

    @classmethod
    def from_fields(cls, entry_id: bytes | str, fields: Fields) -> InboxEntry:
        """Raises LayoutError for an entry that does not parse.

        A well-formed entry (every entry the scripts write) is read in one pass of dictionary
        lookups, once per job on the worker's hot path; anything else goes to :meth:`_checked`,
        which reads it field by field and names what is wrong."""
        try:
            packed = fields.get(PACKED)
            if packed is not None:
                # PACKED_PARTS in order, unpacked inline on this hot path (layouts.unpacked is the slow one)
                kind_b, step_b, contextual, gen, mode, enqueued_ms, attempt, model = packed.split(b"\0", 7)
            else:
                kind_b, step_b, contextual, gen = (fields[b"kind"], fields[b"step_id"], fields[b"contextual"],
                                                   fields[b"gen"])
                mode, model, enqueued_ms, attempt = (fields[b"mode"], fields[b"model"], fields[b"enqueued_ms"],
                                                     fields[b"attempt"])
            kind = _KIND_OF[kind_b]
            step_id = int(step_b)
            low = _LOWEST_STEP_ID.get(kind)
            if low <= step_id <= MAX_STEP_ID if low is not None else step_id == -1:
                return cls(
                    entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
                    kind=kind, job_id=fields[b"job_id"].decode(), session_id=fields[b"session_id"].decode(),
                    step_id=step_id, contextual=contextual.decode() == "1",
                    epoch=int(fields[b"epoch"]), gen=int(gen), mode=_MODE_OF[mode],
                    model=model.decode(), reply_to=fields[b"reply_to"].decode(),
                    enqueued_ms=int(enqueued_ms), attempt=int(attempt),
                    payload=fields.get(b"payload", b""), retention=fields.get(b"retention", b"full").decode(),
                    min_version=int(fields.get(b"min_version", b"0")),
                    priority=_PRIORITY_OF[fields.get(b"priority", _DEFAULT_PRIORITY)],
                    cancels=int(fields.get(b"cancels", b"0")),
                )
        except (KeyError, TypeError, ValueError):  # UnicodeDecodeError is a ValueError; so is a short unpack
            pass
        return cls._checked(entry_id, unpacked(fields))

    @classmethod
    def _checked(cls, entry_id: bytes | str, fields: Fields) -> InboxEntry:
        """:meth:`from_fields`, field by field: the LayoutError names the field that does not parse."""
        try:
            kind = JobKind(text(fields, "kind"))
        except ValueError:
            raise LayoutError(f"unknown job kind {text(fields, 'kind')!r}") from None
        try:
            mode = Mode(text(fields, "mode"))
        except ValueError as exc:
            raise LayoutError(str(exc)) from exc
        try:
            priority = Priority(text(fields, "priority", DEFAULT_PRIORITY.value))
        except ValueError as exc:
            raise LayoutError(f"field 'priority': {exc}") from exc
        step_id = integer(fields, "step_id")
        low = _LOWEST_STEP_ID.get(kind)
        if not (low <= step_id <= MAX_STEP_ID if low is not None else step_id == -1):
            raise LayoutError(f"field 'step_id' is out of range for a {kind.value} job: {step_id}")
        return cls(
            entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            kind=kind, job_id=text(fields, "job_id"), session_id=text(fields, "session_id"),
            step_id=step_id, contextual=text(fields, "contextual") == "1",
            epoch=integer(fields, "epoch"), gen=integer(fields, "gen"), mode=mode, model=text(fields, "model"),
            reply_to=text(fields, "reply_to"), enqueued_ms=integer(fields, "enqueued_ms"),
            attempt=integer(fields, "attempt"), payload=fields.get(b"payload", b""),
            retention=text(fields, "retention", "full"), min_version=integer(fields, "min_version", 0),
            priority=priority,
            cancels=integer(fields, "cancels", 0),
        )

    @property
    def input_staged(self) -> bool:
        """The step's payload is in its input blob (broker/redis/inputs.py), not in the entry."""
        return self.kind is JobKind.STEP and is_staged(self.payload)

    def dead_letter(self, reason: str, attempts: int, worker_id: str, failed_ms: int,
                    kept: tuple[bytes, str] | None = None) -> DeadLetter:
        """Everything a replay needs (the payload only under its byte budget), plus why and how
        often it failed. ``kept``: the payload and why not, read from a staged input's blob."""
        payload, dropped = kept if kept is not None else dead_letter_payload(self.payload)
        return DeadLetter(
            reason=reason, attempts=attempts, worker_id=worker_id, failed_ms=failed_ms, kind=self.kind,
            job_id=self.job_id, session_id=self.session_id, step_id=self.step_id, contextual=self.contextual,
            mode=self.mode.value, model=self.model, reply_to=self.reply_to, enqueued_ms=self.enqueued_ms,
            payload=payload, min_version=self.min_version, payload_dropped=dropped,
        )

    def dead_letter_fields(self, reason: str, attempts: int, worker_id: str, failed_ms: int,
                           kept: tuple[bytes, str] | None = None) -> dict[str, object]:
        letter = self.dead_letter(reason, attempts, worker_id, failed_ms, kept)
        return {str(name): value for name, value in letter.to_fields().items()}


@dataclass(frozen=True)
class BadEntry:
    """An entry that does not parse; answered if it names where to answer."""

    entry_id: str
    reason: str
    session_id: str | None
    job_id: str | None
    reply_to: str | None
    fields: dict[bytes, bytes]

    def dead_letter(self, worker_id: str) -> DeadLetter:
        return DeadLetter(reason=f"invalid_request: {self.reason}", inbox_entry_id=self.entry_id,
                          worker_id=worker_id, job_id=self.job_id or "", session_id=self.session_id or "")


def parse_inbox_entry(entry_id: bytes | str, fields: dict[bytes, bytes]) -> InboxEntry | BadEntry:
    try:
        return InboxEntry.from_fields(entry_id, fields)
    except LayoutError as exc:
        def opt(name: str) -> str | None:
            raw = fields.get(name.encode())
            return raw.decode("utf-8", "replace") if raw is not None else None

        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return BadEntry(eid, str(exc), opt("session_id"), opt("job_id"), opt("reply_to"), fields)
