"""The supervisor's arq queue without pickle, on the fleet's own connection settings.

arq stores every job and result with ``pickle`` unless told otherwise, so whoever could write one
``arq:job:*`` key and a queue entry could run code as the supervisor's user. Every arq pool of the
fleet (the supervisor's worker, :func:`broker.ops.supervisor.request_replay`) is built here, with
msgpack (de)serializers: a job that is not msgpack fails to decode, and arq drops it with a log.

The pool is built from the cell's URL by redis-py's own parser (through
:func:`broker.redis.connect.open_pool`), exactly as workers and clients connect, so
``rediss://`` query parameters (``ssl_ca_certs``, ``ssl_cert_reqs``...), the username and the
password all reach arq; ``RedisSettings.from_dsn`` keeps only host, port, db and credentials.
"""

from __future__ import annotations

from typing import Any

import msgpack
from arq import constants as arq_constants
from arq.connections import ArqRedis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from broker.redis.backoff import CAP_S, REDIS_ERRORS, START_S
from broker.redis.config import CellConfig
from broker.redis.connect import open_pool

# A replay request is a few filters; a result is a list of outcomes. A job larger than this is
# not one the fleet wrote, and is refused before msgpack allocates anything for it.
MAX_ARQ_JOB_BYTES = 1 << 20

# The keys arq writes outside the cell's prefix (fixed by arq; the queue and its health-check key
# are the cell's own, ``CellKeys.arq_queue``). The ACL of a supervisor must name them.
ARQ_KEY_PATTERNS: tuple[str, ...] = (
    f"{arq_constants.job_key_prefix}*",
    f"{arq_constants.in_progress_key_prefix}*",
    f"{arq_constants.result_key_prefix}*",
    f"{arq_constants.retry_key_prefix}*",
    arq_constants.abort_jobs_ss,
)

# arq's own create_pool retried a refused connection 5 times, 1 s apart; this keeps that tolerance
# (about 9 s in all) with the fleet's backoff, for every command rather than only the first.
# OSError is in the list because a refused connect surfaces as one, before redis-py wraps it.
CONNECT_RETRIES = 8


def _plain(obj: object) -> object:
    """What msgpack cannot carry natively. arq stores a failed job's exception as its result: it
    travels as its text. Anything else is refused (arq then records a serialization error)."""
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    raise TypeError(f"cannot serialize {type(obj).__name__} into an arq job")


def pack_arq(obj: Any) -> bytes:
    """arq's ``job_serializer``: msgpack, never pickle."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, default=_plain)
    return packed


def unpack_arq(data: bytes) -> Any:
    """arq's ``job_deserializer``: msgpack only and bounded; anything else raises, and arq fails
    the job ("deserializing job ... failed") without running it."""
    if len(data) > MAX_ARQ_JOB_BYTES:
        raise ValueError(f"arq job of {len(data)} bytes refused (at most {MAX_ARQ_JOB_BYTES})")
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def arq_pool(config: CellConfig) -> ArqRedis:
    """An arq pool on the cell's Redis, with the msgpack serializers and the cell's queue."""
    retry = Retry(ExponentialBackoff(cap=CAP_S, base=START_S), CONNECT_RETRIES)
    connections = open_pool(config.redis_url, retry=retry, retry_on_error=list(REDIS_ERRORS))
    pool = ArqRedis(connections, job_serializer=pack_arq, job_deserializer=unpack_arq,
                    default_queue_name=config.keys.arq_queue)
    pool.auto_close_connection_pool = True  # the pool is this client's alone: aclose() closes it
    return pool
