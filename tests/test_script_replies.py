"""Every reply shape of every Lua script, decoded into its type; malformed replies are refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from broker.redis import script_replies as r
from schemas.errors import ErrorCode, ScriptError

# (decoder, raw reply as redis-py returns it, typed reply)
SHAPES: list[tuple[Callable[[Any], object], list[Any], object]] = [
    (r.decode_create, [b"created", b"w1"], r.Created("w1")),
    (r.decode_create, [b"error", b"capacity_exhausted", b"no worker"],
     r.Refused(ErrorCode.CAPACITY_EXHAUSTED, "no worker")),
    (r.decode_enqueue, [b"queued", b"1-0", 3], r.Queued("1-0", 3)),
    (r.decode_enqueue, [b"stored", b"\x81\xa1r\x01", 4], r.Stored(b"\x81\xa1r\x01", 4)),
    (r.decode_enqueue, [b"error", b"session_closed", b"closed", 2, b"7"],
     r.Refused(ErrorCode.SESSION_CLOSED, "closed", 2, 7)),
    (r.decode_enqueue, [b"error", b"step_out_of_order", b"queued", 2, b"7", b"in_flight"],
     r.Refused(ErrorCode.STEP_OUT_OF_ORDER, "queued", 2, 7, in_flight=True)),
    (r.decode_enqueue, [b"moved", b"w2"], r.Moved("w2")),
    (r.decode_control, [b"queued", b"1-1", -1], r.Queued("1-1", -1)),
    (r.decode_control, [b"already_closed", 5], r.AlreadyClosed(5)),
    (r.decode_control, [b"error", b"session_not_found", b"gone", -1, 0],
     r.Refused(ErrorCode.SESSION_NOT_FOUND, "gone", -1, 0)),
    (r.decode_control, [b"moved", b"w3"], r.Moved("w3")),
    (r.decode_commit, [b"committed"], r.Committed()),
    (r.decode_commit, [b"duplicate"], r.Duplicate()),
    (r.decode_commit, [b"duplicate_unstored", 9], r.DuplicateUnstored(9)),
    (r.decode_commit, [b"fenced", b"w2", b"3"], r.StaleOwner("w2", 3)),
    (r.decode_commit, [b"fenced", b"", b""], r.StaleOwner(None, None)),
    (r.decode_commit, [b"out_of_order", 1], r.OutOfOrder(1)),
    (r.decode_report, [b"published", 4], r.Published(4)),
    (r.decode_report, [b"fenced", b"w2", b"2"], r.StaleOwner("w2", 2)),
    (r.decode_apply_control, [b"applied", -1], r.Applied(-1)),
    (r.decode_apply_control, [b"fenced", b"w2", b"2"], r.StaleOwner("w2", 2)),
    (r.decode_apply_control, [b"unrequested", 3], r.Unrequested(3)),
    (r.decode_failover, [b"moved", 2, 5], r.FailedOver(2, 5)),
    (r.decode_failover, [b"skip", b"w9"], r.Skipped("w9")),
    (r.decode_failover, [b"gone"], r.Gone()),
    (r.decode_failover, [b"alive"], r.Alive()),
    (r.decode_failover, [b"retry", b"new owner w2 is not live"], r.Retry("new owner w2 is not live")),
    (r.decode_retire, [b"retired", 3], r.Retired(3)),
    (r.decode_retire, [b"alive"], r.Alive()),
    (r.decode_heartbeat, [1_700_000_000_000, 1], r.Heartbeat(1_700_000_000_000, True)),
    (r.decode_heartbeat, [1_700_000_000_000, 0], r.Heartbeat(1_700_000_000_000, False)),
]


@pytest.mark.parametrize(("decode", "raw", "typed"), SHAPES, ids=lambda v: getattr(v, "__name__", None))
def test_every_reply_shape_decodes_to_its_type(decode: Callable[[Any], object], raw: list[Any],
                                               typed: object) -> None:
    assert decode(raw) == typed


MALFORMED: list[tuple[Callable[[Any], object], Any, str]] = [
    (r.decode_commit, None, "non-empty list"),
    (r.decode_commit, [], "non-empty list"),
    (r.decode_commit, [b"comitted"], "unknown status 'comitted'"),
    (r.decode_commit, [b"committed", 1], "takes 0 values, got 1"),
    (r.decode_commit, [b"out_of_order"], "takes 1 values, got 0"),
    (r.decode_commit, [b"out_of_order", b"x"], "not an integer"),
    (r.decode_enqueue, [b"error", b"no_such_code", b"m", 1, 0], "unknown error code"),
    (r.decode_enqueue, [b"stored", 7, 1], "not bytes"),
    (r.decode_enqueue, [b"moved", b"\xff"], "not utf-8"),
    (r.decode_control, [b"error", b"session_closed", b"m", 1, 0, b"in_flight"], "takes 4 values"),
    (r.decode_failover, [b"moved", 2], "takes 2 values, got 1"),
    (r.decode_heartbeat, [1], "expected {now, registered}"),
    (r.decode_heartbeat, [b"x", 1], "not two integers"),
]


@pytest.mark.parametrize(("decode", "raw", "why"), MALFORMED, ids=lambda v: getattr(v, "__name__", None))
def test_a_malformed_reply_raises_a_clear_error(decode: Callable[[Any], object], raw: Any, why: str) -> None:
    with pytest.raises(ScriptError, match=re.escape(why)) as info:
        decode(raw)
    assert info.value.message.split(".lua:", 1)[0] in {"create", "enqueue", "control", "commit", "report",
                                                     "apply_control", "failover", "retire", "heartbeat"}


def test_single_integer_replies() -> None:
    assert r.decode_integer("register", 1_700_000_000_000) == 1_700_000_000_000
    assert r.decode_integer("ack_result", 0) == 0
    with pytest.raises(ScriptError, match=r"ack_result\.lua: expected an integer"):
        r.decode_integer("ack_result", [1])
