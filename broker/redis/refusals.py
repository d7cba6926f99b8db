"""Redis refusing writes: the errors of a server that is up but will not write now.

A Redis at ``maxmemory`` with ``noeviction`` answers ``OOM``, one whose RDB or AOF persistence
fails (``stop-writes-on-bgsave-error yes``) ``MISCONF``, a replica ``READONLY``, a master short of
``min-replicas-to-write`` ``NOREPLICAS``, and one running a long script ``BUSY``. None of them
changes anything (a script is refused at its first write, before any; docs/faults.md) and each
passes once the operator acts, so the fleet treats them as an outage: retried with backoff, a
trainer answered ``redis_unavailable`` with the reason once its reconnect window is over, a worker's
jobs left pending and committed once Redis writes again.

redis-py raises OOM and READONLY as their own classes and the others as a plain ``ResponseError``
that starts with the code; the clients :mod:`broker.redis.connect` builds parse those three as their
own classes too (:func:`refusing`), so ``broker.redis.backoff.REDIS_ERRORS`` lists every refusal
and each loop that rides out an outage rides these out as well. :func:`refusal_of` reads both
shapes (a cluster client keeps redis-py's parser). A script call's refusal is raised as
:class:`RedisRefused` (:mod:`broker.redis.scripts`), a connection error that names the reason.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cache
from typing import Any

from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError


class Refusal(StrEnum):
    """Why Redis refused a write (the ``reason`` label of ``rollout_fleet_redis_refusals_total``)."""

    OOM = "oom"  # used_memory over maxmemory with noeviction
    MISCONF = "misconf"  # persistence failing with stop-writes-on-bgsave-error yes (or AOF write errors)
    READONLY = "readonly"  # a replica (the master failed over, or the URL names a replica)
    NOREPLICAS = "noreplicas"  # fewer good replicas than min-replicas-to-write
    BUSY = "busy"  # a script past busy-reply-threshold (lua-time-limit): SCRIPT KILL or wait


_BY_CODE = {"MISCONF": Refusal.MISCONF, "NOREPLICAS": Refusal.NOREPLICAS, "BUSY": Refusal.BUSY,
            "OOM": Refusal.OOM, "READONLY": Refusal.READONLY}


class MisconfError(ResponseError):
    """``MISCONF``: writes stopped because persistence (an RDB save, the AOF) failed."""


class BusyScriptError(ResponseError):
    """``BUSY``: a script or function ran past busy-reply-threshold; every command waits for it."""


class NoReplicasError(ResponseError):
    """``NOREPLICAS``: fewer good replicas than min-replicas-to-write."""


class UnblockedError(ResponseError):
    """``UNBLOCKED``: a blocked read the server ended because it became a replica (READONLY
    follows); not a refusal itself, but the same passing state: read again after a backoff."""


_PARSED = {"MISCONF": MisconfError, "BUSY": BusyScriptError, "NOREPLICAS": NoReplicasError,
           "UNBLOCKED": UnblockedError}


_BY_CLASS = ((OutOfMemoryError, Refusal.OOM), (ReadOnlyError, Refusal.READONLY), (MisconfError, Refusal.MISCONF),
             (BusyScriptError, Refusal.BUSY), (NoReplicasError, Refusal.NOREPLICAS))


@cache
def refusing(parser: type[BaseParser]) -> type[Any]:
    """``parser`` that also raises MISCONF, BUSY, NOREPLICAS and UNBLOCKED as their own classes (redis-py
    looks error codes up in the parser's ``EXCEPTION_CLASSES``)."""
    return type(f"Refusing{parser.__name__}", (parser,),
                {"EXCEPTION_CLASSES": {**parser.EXCEPTION_CLASSES, **_PARSED}})


class RedisRefused(RedisConnectionError):
    """A command Redis refused for a while (:class:`Refusal`); nothing was written."""

    def __init__(self, reason: Refusal, detail: str) -> None:
        super().__init__(f"redis refused the call ({reason.value}): {detail}")
        self.reason = reason


def refusal_of(exc: BaseException) -> Refusal | None:
    """The refusal ``exc`` is, or None for any other error (``BUSYGROUP``, a script bug, ...)."""
    if isinstance(exc, RedisRefused):
        return exc.reason
    for cls, reason in _BY_CLASS:
        if isinstance(exc, cls):
            return reason
    if isinstance(exc, ResponseError):  # a client with redis-py's own parser (a cluster client)
        return _BY_CODE.get(str(exc).split(" ", 1)[0])
    return None


def as_refused(exc: Exception) -> Exception:
    """``exc`` as a :class:`RedisRefused` when it is a refusal, else ``exc`` itself."""
    reason = refusal_of(exc)
    if reason is None or isinstance(exc, RedisRefused):
        return exc
    refused = RedisRefused(reason, str(exc))
    refused.__cause__ = exc
    return refused
