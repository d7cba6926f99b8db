"""The typed answers of the Lua scripts, decoded in one place.

Each script answers a list whose first element names its shape (the ``Returns`` line of its
header); its ``decode_<script>`` function turns that list into one of the dataclasses below, checking the arity and
the types, so no caller reads a reply by position or compares a status string (callers match on
the type instead). A reply that fits no shape raises :class:`ScriptError`: a script and
its wrapper disagree, a bug.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from schemas.errors import ErrorCode, ScriptError
from schemas.records import quick_init

T = TypeVar("T")


# ---------------------------------------------------------------------- shapes shared by scripts

@quick_init
@dataclass(frozen=True)
class Refused:
    """The request can never succeed as sent (create, enqueue, control): the trainer sees ``code``.
    ``in_flight``: the refused step is the one already queued (a retry after a lost reply)."""

    code: ErrorCode
    message: str
    committed_step_id: int = -1
    context_length: int = 0
    in_flight: bool = False


@dataclass(frozen=True)
class Moved:
    """The session is owned by another worker than the caller believed (enqueue, control)."""

    owner: str


@quick_init
@dataclass(frozen=True)
class Queued:
    """A job was added to the owner's inbox (enqueue, control)."""

    entry_id: str
    committed_step_id: int


@dataclass(frozen=True)
class StaleOwner:
    """Fencing refused the call: the caller is not the owner at this lease epoch any more
    (``owner``/``epoch`` are the current ones; None when the session is gone)."""

    owner: str | None
    epoch: int | None


@dataclass(frozen=True)
class Alive:
    """The worker's heartbeat is within its lease: nothing was taken from it (failover, retire)."""


# ---------------------------------------------------------------------- one script each

@dataclass(frozen=True)
class Created:
    owner: str


@quick_init
@dataclass(frozen=True)
class Stored:
    """The step is committed already; its stored result, for an idempotent retry."""

    result: bytes
    committed_step_id: int


@dataclass(frozen=True)
class AlreadyClosed:
    committed_step_id: int


@dataclass(frozen=True)
class Committed:
    pass


@dataclass(frozen=True)
class Duplicate:
    """The step was committed earlier; its stored result was published again."""


@dataclass(frozen=True)
class DuplicateUnstored:
    """The step was committed earlier and its result left the result window."""

    committed_step_id: int


@dataclass(frozen=True)
class OutOfOrder:
    committed_step_id: int


@dataclass(frozen=True)
class CancelledCommit:
    """commit.lua refused a step enqueued before the session's last cancel (cancel.lua)."""

    committed_step_id: int


@dataclass(frozen=True)
class Cancelled:
    """cancel.lua: the steps from ``committed_step_id + 1`` up to ``next_before - 1`` will answer
    ``cancelled``; the session's next step is ``next_step_id``."""

    committed_step_id: int
    next_before: int
    next_step_id: int


@dataclass(frozen=True)
class Forked:
    """fork.lua: the branches exist, each committed up to ``committed_step_id`` (the fork point)."""

    committed_step_id: int


@dataclass(frozen=True)
class Published:
    committed_step_id: int


@dataclass(frozen=True)
class Applied:
    committed_step_id: int


@dataclass(frozen=True)
class Unrequested:
    """A reset entry control.lua never enqueued (no reset pending): fenced off, nothing changed."""

    committed_step_id: int


@dataclass(frozen=True)
class FailedOver:
    epoch: int
    jobs_moved: int


@dataclass(frozen=True)
class Skipped:
    """Someone else owns the session now; nothing to move."""

    owner: str


@dataclass(frozen=True)
class Gone:
    """The session no longer exists."""


@dataclass(frozen=True)
class Retry:
    """The chosen new owner cannot take the session now."""

    why: str


@dataclass(frozen=True)
class Retired:
    orphans: int


@dataclass(frozen=True)
class IdleClosed:
    """close_idle.lua closed the session, idle this long."""

    idle_ms: int


@dataclass(frozen=True)
class IdleKept:
    """close_idle.lua kept the session: ``wait_ms`` until it could be idle (-1: it has no idle
    timeout), or None when it is not the caller's to watch (another owner's, or closed)."""

    wait_ms: int | None


@dataclass(frozen=True)
class Heartbeat:
    now_ms: int
    registered: bool
    workers: int = 0  # workers registered in the cell (the full heartbeat counts them)
    owned: int = 0  # sessions the worker owns, by the cell's owned hash
    described: bool = True  # False: the worker hash had expired; every field is due again


IdleReply = IdleClosed | IdleKept
CreateReply = Created | Refused
EnqueueReply = Queued | Stored | Refused | Moved
ControlReply = Queued | AlreadyClosed | Refused | Moved
CommitReply = Committed | Duplicate | DuplicateUnstored | StaleOwner | OutOfOrder | CancelledCommit
CancelReply = Cancelled | Refused | Moved
ForkReply = Forked | Refused | Moved
ReportReply = Published | StaleOwner
ApplyControlReply = Applied | StaleOwner | Unrequested
FailoverReply = FailedOver | Skipped | Gone | Alive | Retry
RetireReply = Retired | Alive


# ---------------------------------------------------------------------- decoding

class _Values:
    """The elements after the status word, read with the script's name in every error."""

    def __init__(self, script: str, raw: Sequence[Any]) -> None:
        self.script = script
        self.raw = raw

    def fail(self, why: str) -> ScriptError:
        return ScriptError(f"{self.script}.lua: {why} in reply {list(self.raw)!r}")

    def item(self, index: int) -> Any:
        if index + 1 >= len(self.raw):
            raise self.fail(f"missing element {index + 1}")
        return self.raw[index + 1]

    def text(self, index: int) -> str:
        value = self.item(index)
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.fail(f"element {index + 1} is not utf-8") from exc
        if isinstance(value, int):
            return str(value)
        raise self.fail(f"element {index + 1} is not a string")

    def optional_text(self, index: int) -> str | None:
        return self.text(index) or None

    def integer(self, index: int) -> int:
        try:
            return int(self.text(index))
        except ValueError as exc:
            raise self.fail(f"element {index + 1} is not an integer") from exc

    def optional_integer(self, index: int) -> int | None:
        return None if self.text(index) == "" else self.integer(index)

    def blob(self, index: int) -> bytes:
        value = self.item(index)
        if not isinstance(value, bytes):
            raise self.fail(f"element {index + 1} is not bytes")
        return value

    def code(self, index: int) -> ErrorCode:
        try:
            return ErrorCode(self.text(index))
        except ValueError as exc:
            raise self.fail(f"unknown error code at element {index + 1}") from exc


@dataclass(frozen=True)
class _Shape(Generic[T]):
    """One reply shape: how many values follow the status word, and how to build the result."""

    sizes: tuple[int, ...]
    build: Callable[[_Values], T]


def _refused(v: _Values) -> Refused:
    if len(v.raw) == 3:  # create's errors name no session state
        return Refused(v.code(0), v.text(1))
    in_flight = len(v.raw) == 6 and v.text(4) == "in_flight"
    return Refused(v.code(0), v.text(1), v.integer(2), v.integer(3), in_flight)


def _moved(v: _Values) -> Moved:
    return Moved(v.text(0))


def _queued(v: _Values) -> Queued:
    return Queued(v.text(0), v.integer(1))


def _stale(v: _Values) -> StaleOwner:
    return StaleOwner(v.optional_text(0), v.optional_integer(1))


def _alive(v: _Values) -> Alive:
    return Alive()


_CREATE: Mapping[str, _Shape[CreateReply]] = {
    "created": _Shape((1,), lambda v: Created(v.text(0))), "error": _Shape((2,), _refused)}
_ENQUEUE: Mapping[str, _Shape[EnqueueReply]] = {
    "queued": _Shape((2,), _queued), "stored": _Shape((2,), lambda v: Stored(v.blob(0), v.integer(1))),
    "error": _Shape((4, 5), _refused), "moved": _Shape((1,), _moved)}
_CONTROL: Mapping[str, _Shape[ControlReply]] = {
    "queued": _Shape((2,), _queued), "already_closed": _Shape((1,), lambda v: AlreadyClosed(v.integer(0))),
    "error": _Shape((4,), _refused), "moved": _Shape((1,), _moved)}
_COMMIT: Mapping[str, _Shape[CommitReply]] = {
    "committed": _Shape((0,), lambda v: Committed()), "duplicate": _Shape((0,), lambda v: Duplicate()),
    "duplicate_unstored": _Shape((1,), lambda v: DuplicateUnstored(v.integer(0))),
    "fenced": _Shape((2,), _stale), "out_of_order": _Shape((1,), lambda v: OutOfOrder(v.integer(0))),
    "cancelled": _Shape((1,), lambda v: CancelledCommit(v.integer(0)))}
_CANCEL: Mapping[str, _Shape[CancelReply]] = {
    "cancelled": _Shape((3,), lambda v: Cancelled(v.integer(0), v.integer(1), v.integer(2))),
    "error": _Shape((4,), _refused), "moved": _Shape((1,), _moved)}
_FORK: Mapping[str, _Shape[ForkReply]] = {
    "forked": _Shape((1,), lambda v: Forked(v.integer(0))), "error": _Shape((4,), _refused),
    "moved": _Shape((1,), _moved)}
_REPORT: Mapping[str, _Shape[ReportReply]] = {
    "published": _Shape((1,), lambda v: Published(v.integer(0))), "fenced": _Shape((2,), _stale)}
_APPLY_CONTROL: Mapping[str, _Shape[ApplyControlReply]] = {
    "applied": _Shape((1,), lambda v: Applied(v.integer(0))), "fenced": _Shape((2,), _stale),
    "unrequested": _Shape((1,), lambda v: Unrequested(v.integer(0)))}
_CLOSE_IDLE: Mapping[str, _Shape[IdleReply]] = {
    "closed": _Shape((1,), lambda v: IdleClosed(v.integer(0))),
    "kept": _Shape((0, 1), lambda v: IdleKept(v.integer(0) if len(v.raw) == 2 else None))}
_FAILOVER: Mapping[str, _Shape[FailoverReply]] = {
    "moved": _Shape((2,), lambda v: FailedOver(v.integer(0), v.integer(1))),
    "skip": _Shape((1,), lambda v: Skipped(v.text(0))), "gone": _Shape((0,), lambda v: Gone()),
    "alive": _Shape((0,), _alive), "retry": _Shape((1,), lambda v: Retry(v.text(0)))}
_RETIRE: Mapping[str, _Shape[RetireReply]] = {
    "retired": _Shape((1,), lambda v: Retired(v.integer(0))), "alive": _Shape((0,), _alive)}


def _decode(script: str, raw: Any, shapes: Mapping[str, _Shape[T]]) -> T:
    if not isinstance(raw, list) or not raw:
        raise ScriptError(f"{script}.lua: expected a non-empty list, got {raw!r}")
    values = _Values(script, raw)
    status = raw[0].decode("utf-8", "replace") if isinstance(raw[0], bytes) else str(raw[0])
    shape = shapes.get(status)
    if shape is None:
        raise values.fail(f"unknown status {status!r} (expected one of {sorted(shapes)})")
    if len(raw) - 1 not in shape.sizes:
        raise values.fail(f"{status!r} takes {' or '.join(map(str, shape.sizes))} values, got {len(raw) - 1}")
    return shape.build(values)


def decode_create(raw: Any) -> CreateReply:
    return _decode("create", raw, _CREATE)


def decode_enqueue(raw: Any) -> EnqueueReply:
    return _decode("enqueue", raw, _ENQUEUE)


def decode_control(raw: Any) -> ControlReply:
    return _decode("control", raw, _CONTROL)


def decode_commit(raw: Any) -> CommitReply:
    return _decode("commit", raw, _COMMIT)


def decode_cancel(raw: Any) -> CancelReply:
    return _decode("cancel", raw, _CANCEL)


def decode_fork(raw: Any) -> ForkReply:
    return _decode("fork", raw, _FORK)


def decode_report(raw: Any) -> ReportReply:
    return _decode("report", raw, _REPORT)


def decode_apply_control(raw: Any) -> ApplyControlReply:
    return _decode("apply_control", raw, _APPLY_CONTROL)


def decode_close_idle(raw: Any) -> IdleReply:
    """close_idle.lua: closed (how long idle) or kept (and when to look again)."""
    return _decode("close_idle", raw, _CLOSE_IDLE)


def decode_failover(raw: Any) -> FailoverReply:
    return _decode("failover", raw, _FAILOVER)


def decode_retire(raw: Any) -> RetireReply:
    return _decode("retire", raw, _RETIRE)


def decode_heartbeat(raw: Any) -> Heartbeat:
    """heartbeat.lua answers ``{now, still_registered, workers, owned, described}`` (the first two
    alone from a script of before the counts) with no status word."""
    if not isinstance(raw, list) or len(raw) not in (2, 5):
        raise ScriptError(f"heartbeat.lua: expected {{now, registered}} or {{now, registered, workers, owned, "
                          f"described}}, got {raw!r}")
    try:
        now, registered, *rest = (int(v) for v in raw)
    except (TypeError, ValueError) as exc:
        raise ScriptError(f"heartbeat.lua: not two integers: {raw!r}") from exc
    if not rest:
        return Heartbeat(now, bool(registered))
    return Heartbeat(now, bool(registered), rest[0], rest[1], bool(rest[2]))


def decode_integer(script: str, raw: Any) -> int:
    """register.lua (now) and ack_result.lua (first time 1 / duplicate 0) answer one integer."""
    if isinstance(raw, bool) or not isinstance(raw, int | bytes):
        raise ScriptError(f"{script}.lua: expected an integer, got {raw!r}")
    try:
        return int(raw)
    except ValueError as exc:
        raise ScriptError(f"{script}.lua: expected an integer, got {raw!r}") from exc
