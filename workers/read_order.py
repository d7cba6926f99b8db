"""The order in which the reader hands one inbox read to the lanes: interactive sessions first.

The reader admits entries one at a time, each waiting for a free slot of ``max_inflight``; on a
saturated worker an interactive step read behind a run of bulk ones would wait for all of them.
Sorting by each session's class puts it first. Every entry of one session gets the same key (the
best class among that session's entries in the read: a reset or close carries none), and the sort
is stable, so a session's jobs keep their inbox order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from schemas.sharing import Priority

_Entry = TypeVar("_Entry", bound=tuple[Any, Any])
_INTERACTIVE = Priority.INTERACTIVE.value.encode()


def interactive_first(entries: Sequence[_Entry]) -> list[_Entry]:
    """``entries`` (XREADGROUP's (id, fields) pairs) with interactive sessions' entries first."""
    rank: dict[bytes, int] = {}
    for _, fields in entries:
        sid = (fields or {}).get(b"session_id", b"")
        interactive = (fields or {}).get(b"priority") == _INTERACTIVE
        rank[sid] = min(rank.get(sid, Priority.BULK.rank),
                        Priority.INTERACTIVE.rank if interactive else Priority.BULK.rank)
    return sorted(entries, key=lambda entry: rank[(entry[1] or {}).get(b"session_id", b"")])
