"""The trainer side of direct results (schemas/results_wire.py): large results fetched from the worker
that committed them, Redis read only when that worker cannot answer.

A fetch is an optimisation that is allowed to fail: a worker that does not serve results (no
``results_at`` in its hash), is gone, answers late (``timeout_s``), breaks the protocol, or does not
hold the job's result (another worker committed it after a failover, or its hold ran out) makes the
fetch answer None, and the reply reader reads the result blob from Redis as it always did. A worker
whose connection failed is not asked again for ``retry_after_s``, so a dead worker costs its
trainer one timeout, not one per step.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS
from broker.redis.connect import tune_stream
from broker.redis.keys import CellKeys
from schemas.results_wire import ProtocolError, parse_address, read_response, request

log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 2.0  # connect, ask and read the results of one reply read
RETRY_AFTER_S = 10.0  # a worker whose connection failed is read from Redis this long
MAX_WORKERS_KNOWN = 4096  # worker ids whose address is remembered (incarnations: addresses never change)
# The connection's read buffer: a 450 KB answer arrives without pausing the socket at asyncio's
# default 64 KiB (a pause and a resume per 128 KiB read).
READ_LIMIT = 8 * 1024 * 1024


@dataclass
class _Connection:
    """One worker's connection; one batch of requests at a time (its lock)."""

    address: tuple[str, int]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    failed_until: float = float("-inf")

    async def fetch(self, job_ids: list[str]) -> list[bytes | None]:
        """The answers to ``job_ids``, asked in one write (the worker answers them in turn)."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(*self.address, limit=READ_LIMIT)
            tune_stream(self.writer)
        self.writer.write(b"".join(request(job_id) for job_id in job_ids))
        await self.writer.drain()
        return [await read_response(self.reader) for _ in job_ids]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class DirectFetcher:
    """Fetches large results from the workers of one cell (their hashes say where)."""

    def __init__(self, redis: Redis, keys: CellKeys, *, timeout_s: float = FETCH_TIMEOUT_S,
                 retry_after_s: float = RETRY_AFTER_S) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._addresses: dict[str, tuple[str, int] | None] = {}  # worker id -> where (None: serves none)
        self._connections: dict[tuple[str, int], _Connection] = {}
        self.fetched = 0  # results that came from their worker
        self.missed = 0  # fetches that fell back to Redis

    async def fetch(self, worker_id: str, job_ids: list[str]) -> list[bytes | None]:
        """The results of ``job_ids`` from ``worker_id``, each None where it must be read from Redis
        instead; asked together, answered in turn on one connection. Never raises but for
        cancellation; waits ``timeout_s`` at most."""
        none: list[bytes | None] = [None] * len(job_ids)
        try:
            async with asyncio.timeout(self.timeout_s):
                address = await self._address(worker_id)
                if address is None:
                    return none
                conn = self._connections.get(address)
                if conn is None:
                    conn = self._connections[address] = _Connection(address)
                if asyncio.get_running_loop().time() < conn.failed_until:
                    self.missed += len(job_ids)
                    return none
                async with conn.lock:
                    try:
                        got = await conn.fetch(job_ids)
                    except BaseException:
                        conn.close()  # a request half sent or an answer half read: the stream is lost
                        raise
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError, *REDIS_ERRORS) as exc:
            self._failed(worker_id, len(job_ids), exc)
            return none
        served = sum(data is not None for data in got)
        self.fetched += served
        self.missed += len(got) - served
        return got

    def may_serve(self, worker_id: str) -> bool:
        """False for a worker known to serve no results, or whose connection failed a moment ago:
        asking it would only cost a task and a timeout context per read."""
        if worker_id not in self._addresses:
            return True
        address = self._addresses[worker_id]
        if address is None:
            return False
        conn = self._connections.get(address)
        return conn is None or asyncio.get_running_loop().time() >= conn.failed_until

    async def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()

    async def _address(self, worker_id: str) -> tuple[str, int] | None:
        if worker_id in self._addresses:
            return self._addresses[worker_id]
        raw: Any = await resolve(self.redis.hget(self.keys.worker(worker_id), "results_at"))
        address = None
        if raw:
            try:
                address = parse_address(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))
            except ValueError:
                log.warning("worker %s advertises results at %r, which is no HOST:PORT", worker_id, raw)
        if len(self._addresses) >= MAX_WORKERS_KNOWN:
            self._addresses.pop(next(iter(self._addresses)))
        self._addresses[worker_id] = address
        return address

    def _failed(self, worker_id: str, count: int, exc: BaseException) -> None:
        self.missed += count
        address = self._addresses.get(worker_id)
        conn = self._connections.get(address) if address is not None else None
        if conn is not None:
            conn.close()
            conn.failed_until = asyncio.get_running_loop().time() + self.retry_after_s
        log.info("result of worker %s read from Redis: %s", worker_id, str(exc) or type(exc).__name__)

