"""A small rate limiter for the worker's warnings about bad or fenced inbox entries: whoever can
write an inbox can send them by the thousand, and a warning each would flood the log."""

from __future__ import annotations

import logging
import time


class WarningLimiter:
    """At most ``burst`` warnings per ``interval_s``; the next one that passes says how many were
    suppressed meanwhile, so the log still tells how much happened."""

    def __init__(self, logger: logging.Logger, *, burst: int = 3, interval_s: float = 60.0) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self._window_start = float("-inf")
        self._sent = 0
        self.suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.interval_s:
            self._window_start, self._sent = now, 0
        if self._sent >= self.burst:
            self.suppressed += 1
            return
        self._sent += 1
        if self.suppressed:
            message += " (%d similar warnings suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.logger.warning(message, *args)
