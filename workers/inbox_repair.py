"""Recreating a worker's inbox that vanished while the worker is still registered.

Redis lost its data (restarted without persistence, flushed) or an operator deleted the stream:
the reader then gets NOGROUP on every read. If the worker is still registered, its sessions may
still route to it, so it recreates its inbox (empty: what it held is gone, and the trainers waiting
on those jobs learn that their sessions are gone). If it is no longer registered it was retired,
and its heartbeat re-registers it as a new incarnation with a new inbox; recreating the old one
would only leave a stray key behind.
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from broker.redis.backoff import REDIS_ERRORS
from broker.redis.keys import INBOX_GROUP, CellKeys

log = logging.getLogger(__name__)


async def recreate_inbox(redis: Redis, keys: CellKeys, worker_id: str) -> bool:
    """Recreate ``worker_id``'s inbox stream and group if the worker is registered; True if it did."""
    inbox = keys.inbox(worker_id)
    try:
        if await redis.zscore(keys.workers, worker_id) is None:
            return False
        await redis.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):  # BUSYGROUP: someone recreated it first, which is as good
            log.warning("could not recreate inbox %s: %s", inbox, exc)
        return False
    except REDIS_ERRORS as exc:
        log.warning("could not recreate inbox %s: %s", inbox, exc)
        return False
    log.warning("inbox %s was gone; recreated it", inbox)
    return True
