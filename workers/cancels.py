"""What this worker knows of its sessions' cancels (``Session.cancel``): the cancel count of the
last cancel entry read per session. A step enqueued under a lower count is answered ``cancelled``
without running. Bounded: a session forgotten here only loses that shortcut, as commit.lua refuses
a cancelled step's commit on its own."""

from __future__ import annotations

import collections

MAX_SESSIONS = 100_000  # the newest cancels kept; one small int per cancelled session


class CancelMarks:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._marks: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max = max_sessions

    def record(self, session_id: str, cancels: int) -> None:
        """A cancel entry (or a commit refused as cancelled) says the session's count is ``cancels``."""
        self._marks[session_id] = max(self._marks.pop(session_id, 0), cancels)
        while len(self._marks) > self._max:
            self._marks.popitem(last=False)

    def cancelled(self, session_id: str, cancels: int) -> bool:
        """Whether a step enqueued under ``cancels`` was cancelled since."""
        return cancels < self._marks.get(session_id, 0)
