"""The field layouts of the cell's hashes and stream entries, each owned here (encode and decode).

The Lua scripts write the same fields; each script's header names the ones it reads and writes.
Inbox entries live in :mod:`broker.redis.inbox`; the packed step entry's layout (``PACKED``) is
here, as a dead letter an earlier release wrote may carry it. Fields arrive as redis-py gives them
without ``decode_responses``: bytes names, bytes values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.typing import EncodableT, FieldT

from broker.redis.blobs import blob_gone, blob_key
from schemas.codec import decode
from schemas.errors import InvalidRequestError
from schemas.limits import Limits
from schemas.messages import Mode, SessionStatus, StepResult
from schemas.records import quick_init
from schemas.sharing import DEFAULT_PRIORITY, Priority, stored_priority

Fields = Mapping[bytes, bytes]  # as read
Entry = dict[FieldT, EncodableT]  # as written (what redis-py takes)


class LayoutError(ValueError):
    """A hash or stream entry does not have the layout its owner here expects."""


def text(fields: Fields, name: str, default: str | None = None) -> str:
    """One field as text; ``default`` when it is absent (LayoutError if there is no default)."""
    value = fields.get(name.encode())
    if value is None:
        if default is None:
            raise LayoutError(f"missing field {name!r}")
        return default
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LayoutError(f"field {name!r} is not utf-8") from exc


def integer(fields: Fields, name: str, default: int | None = None) -> int:
    raw = text(fields, name, None if default is None else str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise LayoutError(f"field {name!r} is not an integer: {raw!r}") from exc


def optional_integer(fields: Fields, name: str) -> int | None:
    """An integer field that may be absent or empty (None then)."""
    return integer(fields, name) if text(fields, name, "") else None


# ---------------------------------------------------------------------- rf:{c}:session:<sid> HASH

@dataclass(frozen=True)
class SessionHash:
    """A session's record. Written whole by create.lua (but ``first_version``, which the
    trajectory's first commit writes); enqueue, control, commit, report,
    apply_control and failover.lua move single fields (their headers say which). Two fields are
    left out here as they mean nothing to a reader: ``unconfirmed_step``, present only between a
    deferred commit (``durability=replicated``) and the publish after a replica confirmed it, and
    ``last_blob_step``, the highest step committed with its result in a blob (-1: none; absent:
    unknown), by which commit.lua skips deleting the blob of a result that never had one."""

    mode: Mode
    model: str
    owner: str
    epoch: int  # the lease epoch: +1 on every failover (the fence of commit, report, apply_control)
    committed_step_id: int
    next_step_id: int
    context_length: int
    closed: bool
    gen: int = 0  # +1 per reset or step fallback: steps enqueued before it belong to the old one
    reset_pending: int = 0  # resets enqueued and not yet applied (no stored-result retries meanwhile)
    retention: str = "full"
    result_window: int = 1
    created_ms: int = 0
    updated_ms: int = 0  # the last activity: create, a step enqueued or committed, a reset or close
    idle_timeout_ms: int = 0  # its owner closes it after this long unused (0: never)
    idle_closed: bool = False  # closed by its idle timeout (close_idle.lua)
    # The staleness bound (create.lua; None: none) and the policy version the trajectory's first
    # committed step ran on (commit.lua sets it, a reset clears it: docs/async_rl.md).
    max_staleness: int | None = None
    first_version: int | None = None
    priority: Priority = DEFAULT_PRIORITY  # its steps' class on a busy worker (enqueue.lua copies it)
    trainer: str = ""  # whose open-session count it is in (create.lua); "" for sessions from before
    cancels: int = 0  # +1 per cancel (cancel.lua): steps enqueued under a lower count never commit
    forked_from: str = ""  # the parent of a branch made by fork.lua ("" for a created session)

    @classmethod
    def from_fields(cls, fields: Fields) -> SessionHash:
        try:
            mode = Mode(text(fields, "mode"))
        except ValueError as exc:
            raise LayoutError(f"session hash: {exc}") from exc
        return cls(
            mode=mode, model=text(fields, "model"), owner=text(fields, "owner"), epoch=integer(fields, "epoch"),
            committed_step_id=integer(fields, "committed_step_id"), next_step_id=integer(fields, "next_step_id"),
            context_length=integer(fields, "context_length"), closed=text(fields, "closed") == "1",
            gen=integer(fields, "gen", 0), reset_pending=integer(fields, "reset_pending", 0),
            retention=text(fields, "retention", "full"), result_window=integer(fields, "result_window", 1),
            created_ms=integer(fields, "created_ms", 0), updated_ms=integer(fields, "updated_ms", 0),
            idle_timeout_ms=integer(fields, "idle_timeout_ms", 0), idle_closed=text(fields, "idle_closed", "0") == "1",
            max_staleness=optional_integer(fields, "max_staleness"),
            first_version=optional_integer(fields, "first_version"),
            priority=stored_priority(text(fields, "priority", "")),
            trainer=text(fields, "trainer", ""),
            cancels=integer(fields, "cancels", 0), forked_from=text(fields, "forked_from", ""),
        )

    def status(self, session_id: str) -> SessionStatus:
        return SessionStatus(
            session_id=session_id, mode=self.mode, model=self.model, committed_step_id=self.committed_step_id,
            next_step_id=self.next_step_id, context_length=self.context_length, closed=self.closed,
            owner=self.owner, epoch=self.epoch, retention=self.retention,
        )


DEFAULT_IDLE_TIMEOUT_S = 3600.0  # a session unused this long is closed by its owner
MAX_IDLE_TIMEOUT_S = 30 * 86400.0


def idle_timeout_ms_of(idle_timeout_s: object) -> int:
    """A session's idle timeout as stored (ms); InvalidRequestError unless a number of seconds in
    (0, 30 days]."""
    if (isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, int | float)
            or not 0 < idle_timeout_s <= MAX_IDLE_TIMEOUT_S):  # NaN fails the comparison too
        raise InvalidRequestError(f"idle_timeout_s must be a number of seconds in (0, {MAX_IDLE_TIMEOUT_S:.0f}], "
                                  f"got {idle_timeout_s!r}")
    return max(1, round(idle_timeout_s * 1000))


MAX_STALENESS_LIMIT = 1_000_000_000  # policy versions a trajectory may fall behind, at most


def max_staleness_of(max_staleness: object) -> int | None:
    """A session's staleness bound as given to create_session: None (no bound) or an int in
    [0, 1e9]; InvalidRequestError otherwise (nothing is created)."""
    if max_staleness is None:
        return None
    if (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
            or not 0 <= max_staleness <= MAX_STALENESS_LIMIT):
        raise InvalidRequestError(f"max_staleness must be None or an int in [0, {MAX_STALENESS_LIMIT}], "
                                  f"got {max_staleness!r}")
    return max_staleness


# ---------------------------------------------------------------------- rf:{c}:log:<sid> HASH

def log_result_field(step_id: int, result_window: int) -> str:
    """The stored result of a committed step, a large one as a reference to its blob
    (broker/redis/blobs.py, CellKeys.result_blob). The result window is a ring of ``result_window``
    fields (prelude.lua result_field): a commit overwrites the slot of the result that falls out,
    so a field holds this step's result only while the step is inside the window
    (``log_result_steps``). A log written before the ring named a field per step (``result:<step>``)."""
    return f"result@{step_id % result_window}"


def log_result_steps(fields: Iterable[bytes | str], committed_step_id: int, result_window: int) -> list[int]:
    """The steps whose results a log hash with these field names holds, for a session at this
    committed step (prelude.lua slot_step): the window's slots and any field of the earlier
    layout still inside the window."""
    low = committed_step_id - result_window
    steps = set()
    for raw in fields:
        name = raw.decode() if isinstance(raw, bytes) else raw
        kind, sep, number = name.partition("@")
        if kind == "result" and sep and number.isdigit():
            step = committed_step_id - (committed_step_id - int(number)) % result_window
        elif name.startswith("result:") and name[7:].isdigit():
            step = int(name[7:])
        else:
            continue
        if low < step <= committed_step_id and step >= 0:
            steps.add(step)
    return sorted(steps)


def log_input_field(step_id: int) -> str:
    """The step record a new owner replays to rebuild the context (kept per retention)."""
    return f"input:{step_id}"


# The snapshot of a session's engine context (workers/rebuild.py, its snapshots; written by snapshot.lua): in
# the log hash, so it is dropped on reset and expires on close with the step records.
LOG_SNAPSHOT_FIELD = "snapshot"


# ---------------------------------------------------------------------- rf:{c}:handled:<stream>:<group> HASH

def handled_field(session_id: str, step_id: int) -> str:
    """A step a consumer group has handled (ack_result.lua sets it; duplicates are found by it)."""
    return f"{session_id}:{step_id}"


# ---------------------------------------------------------------------- rf:{c}:reply:<consumer> STREAM

@quick_init
@dataclass(frozen=True)
class ReplyEntry:
    """One result for a trainer: written by commit, report and apply_control.lua (and by a worker
    answering a malformed job)."""

    kind: str  # step | reset | close
    job_id: str
    committed: int
    result: bytes  # an encoded StepResult ('' for reset and close), or a reference to its reply blob

    @classmethod
    def from_fields(cls, fields: Fields) -> ReplyEntry:
        return cls(kind=text(fields, "kind", "step"), job_id=text(fields, "job_id", ""),
                   committed=integer(fields, "committed", -1), result=fields.get(b"result", b""))

    def to_fields(self) -> Entry:
        return {"kind": self.kind, "job_id": self.job_id, "committed": self.committed, "result": self.result}

    def step_result(self, limits: Limits, *, total_ms: float | None = None) -> StepResult:
        """The ``StepResult`` the entry carries, decoded once (InvalidRequestError if malformed). A
        reference left unresolved (its blob was gone when read: broker/redis/blobs.py) raises
        step_already_committed: a re-send of the step reads it from the log while its window keeps it.
        ``total_ms``: the client's round trip, which also gives the result this entry's committed
        step id (``StepResult.from_wire``)."""
        key = blob_key(self.result)
        if key is not None:
            raise blob_gone(f"the step of job {self.job_id}", key)
        committed = None if total_ms is None else self.committed
        return StepResult.from_wire(decode(self.result, limits), committed=committed, total_ms=total_ms)


@dataclass(frozen=True)
class ReplyBounds:
    """How commit, report and apply_control.lua bound a reply stream (docs/operations.md): each
    new entry trims the stream (XADD MAXLEN ~) to the entries of its size that ``stream_bytes``
    holds, and a result of ``large_bytes`` or more sets the stream's TTL to ``large_ttl_ms``
    instead of the usual one: a reader that left does not keep latents for an hour."""

    stream_bytes: int = 256 * 1024 * 1024
    large_bytes: int = 1024 * 1024
    large_ttl_ms: int = 600_000

    def __post_init__(self) -> None:
        if min(self.stream_bytes, self.large_bytes, self.large_ttl_ms) <= 0:
            raise ValueError("reply stream bounds must be positive")

    def args(self) -> list[int]:
        """The three ARGV values the scripts read, in this order."""
        return [self.stream_bytes, self.large_bytes, self.large_ttl_ms]


DEFAULT_REPLY_BOUNDS = ReplyBounds()


# ---------------------------------------------------------------------- rf:{c}:dead STREAM

# The dead-letter stream's bound in bytes (docs/operations.md): a letter keeps its payload only
# under DEAD_LETTER_PAYLOAD_BYTES (a larger one is replaced by a marker and is not replayable), and
# the stream keeps DEAD_LETTER_MAXLEN letters (approximate trim, for every writer): at most about
# 2,000 x (64 KiB + the letter's other fields), ~130 MiB, where a count alone let 20 letters of
# 2 MB payloads take 50 MB and 100,000 of them 200 GB.
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
DEAD_LETTER_MAXLEN = 2_000


def dead_letter_payload(payload: bytes) -> tuple[bytes, str]:
    """The payload a dead letter keeps and, when it keeps none, why (retire.lua says the same)."""
    if len(payload) <= DEAD_LETTER_PAYLOAD_BYTES:
        return payload, ""
    return b"", too_large_to_keep(len(payload))


def too_large_to_keep(size: int) -> str:
    """Why a dead letter keeps no payload of ``size`` bytes."""
    return f"payload too large to keep: {size} bytes, over the dead-letter budget of {DEAD_LETTER_PAYLOAD_BYTES} bytes"


# The packed step entry (broker/redis/inbox.py): its field, and its parts in order (enqueue.lua writes
# them; prelude.lua unpacked_entry reads them as this does).
PACKED = b"packed"
PACKED_PARTS = ("kind", "step_id", "contextual", "gen", "mode", "enqueued_ms", "attempt", "model")
# The worker hash field by which a worker says it reads packed entries, and its value.
READS_FIELD = "inbox"
READS_PACKED = "packed"


def unpacked(fields: Fields) -> Fields:
    """A packed entry's fields as the classic layout has them; any other entry as it is. Raises
    LayoutError for a packed field of too few parts."""
    packed = fields.get(PACKED)
    if packed is None:
        return fields
    parts = packed.split(b"\0", len(PACKED_PARTS) - 1)
    if len(parts) != len(PACKED_PARTS):
        raise LayoutError(f"field 'packed' has {len(parts)} parts, not {len(PACKED_PARTS)}")
    out = {name: value for name, value in fields.items() if name != PACKED}
    out.update(zip((name.encode() for name in PACKED_PARTS), parts, strict=True))
    return out


def _optional_step(fields: Fields) -> int | None:
    step = text(fields, "step_id", "")
    return int(step) if step.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class DeadLetter:
    """A job that failed for good, with why: written by report.lua (fields from
    :meth:`broker.redis.inbox.InboxEntry.dead_letter`), by retire.lua (the orphaned inbox entry's
    fields after reason, worker_id, failed_ms) and by a worker for a malformed entry (a few fields,
    ``inbox_entry_id`` among them). Every field but the reason may be absent when read."""

    reason: str
    entry_id: str = ""  # its id in the dead-letter stream (not a field)
    attempts: int = 0
    worker_id: str = ""
    failed_ms: int = 0
    kind: str = ""
    session_id: str = ""
    step_id: int | None = None
    contextual: bool = True
    mode: str = ""
    model: str = ""
    reply_to: str = ""
    job_id: str = ""
    payload: bytes = b""
    enqueued_ms: int | None = None
    min_version: int | None = None
    inbox_entry_id: str | None = None  # the malformed entry's id in its inbox
    payload_dropped: str = ""  # why the payload is not kept (too large), or empty

    @property
    def code(self) -> str:
        """The error code part of the reason (``inference_error: ...`` -> ``inference_error``)."""
        return self.reason.split(":", 1)[0].strip()

    @property
    def replayable(self) -> bool:
        return self.kind == "step" and bool(self.session_id) and self.step_id is not None and bool(self.payload)

    @property
    def not_replayable_why(self) -> str:
        """Why a replay cannot re-enqueue this letter (empty when it can)."""
        if self.replayable:
            return ""
        if self.payload_dropped:
            return f"its {self.payload_dropped}"
        return f"entry is not a step job ({self.reason})"

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: Fields) -> DeadLetter:
        with contextlib.suppress(LayoutError):  # an earlier release's retire.lua kept a packed entry whole
            fields = unpacked(fields)

        def lenient(name: str, default: str = "") -> str:  # dead letters are read whatever they hold
            raw = fields.get(name.encode())
            return raw.decode("utf-8", "replace") if raw is not None else default

        return cls(
            entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            reason=lenient("reason"), attempts=int(lenient("attempts", "0") or 0),
            worker_id=lenient("worker_id"), failed_ms=int(lenient("failed_ms", "0") or 0),
            kind=lenient("kind"), session_id=lenient("session_id"), step_id=_optional_step(fields),
            contextual=lenient("contextual", "1") == "1", mode=lenient("mode"), model=lenient("model"),
            reply_to=lenient("reply_to"), job_id=lenient("job_id"), payload=fields.get(b"payload", b""),
            payload_dropped=lenient("payload_dropped"),
        )

    def to_fields(self) -> Entry:
        """The fields to XADD (absent ones left out), in the order the writers always used."""
        if self.inbox_entry_id is not None:  # a malformed entry: what could be read of it
            return {"reason": self.reason, "entry_id": self.inbox_entry_id, "worker_id": self.worker_id,
                    "job_id": self.job_id, "session_id": self.session_id, "attempts": str(self.attempts)}
        fields: dict[FieldT, EncodableT | None] = {
            "reason": self.reason, "attempts": self.attempts, "worker_id": self.worker_id,
            "failed_ms": self.failed_ms, "kind": self.kind, "job_id": self.job_id,
            "session_id": self.session_id, "step_id": self.step_id, "contextual": "1" if self.contextual else "0",
            "mode": self.mode, "model": self.model, "reply_to": self.reply_to, "enqueued_ms": self.enqueued_ms,
            "payload": self.payload, "min_version": self.min_version, "payload_dropped": self.payload_dropped or None,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def summary(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "session_id": self.session_id, "step_id": self.step_id,
                "code": self.code, "reason": self.reason, "attempts": self.attempts, "worker_id": self.worker_id,
                "failed_ms": self.failed_ms, "payload_bytes": len(self.payload)}
