"""The ``maxmemory-policy`` the fleet needs: ``noeviction``.

Every other policy lets Redis delete keys to make room: ``allkeys-*`` any key, ``volatile-*``
the keys with a TTL (a worker's registry hash, reply streams, result blobs, closed sessions). A
session hash, log or inbox evicted is committed state lost (a step answered ``session_not_found``,
a context that cannot be rebuilt, queued jobs gone) with no error anywhere; under ``noeviction``
Redis refuses the write instead (``OOM``), which the fleet rides out (broker/redis/refusals.py;
docs/faults.md). Workers, supervisors and gateways read the policy at start-up and warn.

``INFO memory`` says ``maxmemory_policy`` and the fleet's minimal ACL allows ``INFO``
(broker/ops/acl.py); ``CONFIG GET`` (``@admin``, which that ACL denies and the ACL log would
record) is tried only where INFO is denied. Neither answering: the policy is unknown.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError

log = logging.getLogger(__name__)
SAFE_POLICY = "noeviction"


async def eviction_policy(redis: Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None when neither INFO nor CONFIG GET tells it."""
    try:
        return _field(await redis.info("memory"), "maxmemory_policy")
    except NoPermissionError:
        pass  # an ACL without INFO: CONFIG GET may still be allowed
    except (RedisError, OSError):
        return None
    try:
        return _field(await redis.config_get("maxmemory-policy"), "maxmemory-policy")
    except (RedisError, OSError):
        return None


def _field(answer: Any, name: str) -> str | None:
    """``name`` of an INFO or CONFIG GET answer: a flat dict, or (a cluster client) one per node."""
    if not isinstance(answer, dict):
        return None
    value = answer.get(name, answer.get(name.encode()))
    if value is None:
        nested = (_field(node, name) for node in answer.values() if isinstance(node, dict))
        return next((v for v in nested if v), None)
    return value.decode() if isinstance(value, bytes) else str(value)


def eviction_problem(policy: str | None) -> str | None:
    """What is wrong with ``policy`` for the fleet, in one line; None when it is safe or unknown."""
    if policy is None or policy == SAFE_POLICY:
        return None
    return (f"maxmemory-policy is {policy}: Redis may evict the fleet's keys (sessions, step logs, inboxes) "
            f"when full and lose committed state without an error; set it to {SAFE_POLICY} (docs/faults.md)")


async def warn_if_evicting(redis: Redis, role: str) -> str | None:
    """Log a warning when the server may evict fleet keys; the problem's line, or None."""
    problem = eviction_problem(await eviction_policy(redis))
    if problem is not None:
        log.warning("%s: %s", role, problem)
    return problem
