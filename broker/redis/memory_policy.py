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
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
SAFE_POLICY = "noeviction"


async def eviction_policy(redis: Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None when neither INFO nor CONFIG GET tells it."""
    for read in (_from_info, _from_config):
        try:
            policy = await read(redis)
        except (RedisError, OSError):  # NOPERM, or a cluster client that answers per node
            continue
        if policy:
            return policy
    return None


async def _from_config(redis: Redis) -> str | None:
    answer: Any = await redis.config_get("maxmemory-policy")
    return _text(answer.get("maxmemory-policy") or answer.get(b"maxmemory-policy")) if isinstance(answer, dict) \
        else None


async def _from_info(redis: Redis) -> str | None:
    answer: Any = await redis.info("memory")
    return _text(answer.get("maxmemory_policy")) if isinstance(answer, dict) else None


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


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
