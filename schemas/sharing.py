"""How trainers share a fleet: a session's priority class and the trainer it counts against.

A worker serves ``interactive`` steps (evaluation, a person waiting) before ``bulk`` ones (training
traffic) when more are waiting than it runs at once; ``bulk`` is the default and what every session
was before priorities existed. Each session belongs to a trainer (a name); an operator may cap the
open sessions of each trainer per cell (``rollout-fleet trainers set-cap``).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from schemas.errors import InvalidRequestError


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"

    @property
    def rank(self) -> int:
        """Lower runs first."""
        return 0 if self is Priority.INTERACTIVE else 1


DEFAULT_PRIORITY = Priority.BULK


def as_priority(value: Any) -> Priority:
    """``interactive`` or ``bulk`` (a Priority or its text); InvalidRequestError otherwise."""
    if isinstance(value, str):
        try:
            return Priority(value)
        except ValueError:
            pass
    raise InvalidRequestError(f"priority must be one of {', '.join(p.value for p in Priority)}, got {value!r:.100}")


def stored_priority(text: str) -> Priority:
    """A priority as a hash stores it; missing (a session from before priorities): bulk."""
    return Priority.INTERACTIVE if text == Priority.INTERACTIVE.value else Priority.BULK


MAX_TRAINER_LENGTH = 64
# Letters, digits and . _ - only: a trainer name is a hash field the CLI prints in a table, and
# ``*`` (the default cap's field) can never be one.
_TRAINER = re.compile(r"[A-Za-z0-9._-]+")
DEFAULT_CAP_FIELD = "*"  # the caps hash's field for the cap of every trainer without its own


def as_trainer(value: Any) -> str:
    """A trainer name: 1-64 characters of letters, digits, ``.``, ``_`` or ``-``."""
    if isinstance(value, str) and len(value) <= MAX_TRAINER_LENGTH and _TRAINER.fullmatch(value):
        return value
    raise InvalidRequestError(f"trainer must be 1-{MAX_TRAINER_LENGTH} letters, digits, '.', '_' or '-', "
                              f"got {value!r:.100}")


MAX_CAP = 1_000_000_000


def as_cap(value: Any) -> int:
    """A cap on a trainer's open sessions: an integer in [0, 10^9] (0: the trainer may open none)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CAP:
        raise InvalidRequestError(f"a trainer cap must be an integer in [0, {MAX_CAP}], got {value!r:.100}")
    return value
