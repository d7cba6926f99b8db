"""The trainer side of a reply stream: one reader task that resolves waiting futures by job id."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from redis.asyncio import Redis

from broker.redis.backoff import REDIS_ERRORS, Backoff
from broker.redis.blobs import blob_key, read_blobs
from broker.redis.connect import cluster_client_errors
from broker.redis.layouts import ReplyEntry

log = logging.getLogger(__name__)
DELETE_WAIT_S = 1.0  # on stop, how long deletes of entries already read may take to finish


class ReplyReader:
    """Reads one reply stream and hands each entry to the future registered for its job id.

    Entries are deleted once read, so the stream only ever holds what no reader has seen yet.
    Unknown job ids (a re-published duplicate, a caller that gave up) are dropped.
    """

    def __init__(self, redis: Redis, stream: str, *, block_ms: int = 1000, batch: int = 512) -> None:
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self.batch = batch
        self._waiters: dict[str, asyncio.Future[ReplyEntry]] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_id = b"0-0"
        self._deletes: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def expect(self, job_id: str) -> asyncio.Future[ReplyEntry]:
        # The reader task's loop (the one that resolves the future), not a lookup per step.
        loop = self._loop if self._task is not None and self._loop is not None else asyncio.get_running_loop()
        fut: asyncio.Future[ReplyEntry] = loop.create_future()
        self._waiters[job_id] = fut
        return fut

    def forget(self, job_id: str) -> None:
        self._waiters.pop(job_id, None)

    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name=f"reply-reader:{self.stream}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # A delete still in flight would outlive the connection pool its owner closes next, and
        # open a fresh connection nobody closes: let it finish (briefly), cancel what is left.
        if self._deletes:
            _, late = await asyncio.wait(set(self._deletes), timeout=DELETE_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            try:
                entries: Any = await self.redis.xread({self.stream: self._last_id}, count=self.batch,
                                                 block=self.block_ms)
                backoff.reset()
            except REDIS_ERRORS as exc:
                if self._stopping:  # redis-py may turn our own cancellation into a connection error
                    return
                log.warning("reply stream %s unreachable (%s); retrying in %.2fs", self.stream, exc, backoff.delay)
                await backoff.wait()
                continue
            if entries:
                await self._dispatch(entries[0][1])

    async def _dispatch(self, items: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        ids: list[Any] = [entry_id for entry_id, _ in items]
        for reply in await self._resolved([ReplyEntry.from_fields(fields) for _, fields in items]):
            fut = self._waiters.pop(reply.job_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
        self._last_id = items[-1][0]
        # Fire-and-forget delete: the stream only keeps unread entries.
        task = asyncio.create_task(self._delete(ids))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _resolved(self, replies: list[ReplyEntry]) -> list[ReplyEntry]:
        """The entries with their result blobs read (broker/redis/blobs.py) and deleted: this reader
        is each blob's one reader, as it is the entry's. The blobs of one read leave as one pipeline
        (one round trip, not one per entry: each would delay the replies behind it). A blob that is
        gone, or Redis unreachable for that read, leaves the reference, which decodes as
        step_already_committed."""
        wanted = [(i, key) for i, reply in enumerate(replies) if (key := blob_key(reply.result)) is not None]
        if not wanted:
            return replies
        failures = REDIS_ERRORS + cluster_client_errors(self.redis)
        try:
            values = await read_blobs(self.redis, [key for _, key in wanted], delete=True)
        except failures as exc:
            log.warning("result blobs of %d replies unreadable: %s", len(wanted), exc)
            return replies
        out = list(replies)
        for (i, key), data in zip(wanted, values, strict=True):
            if isinstance(data, Exception):
                log.warning("result blob %s of job %s unreadable: %s", key, replies[i].job_id, data)
            elif data is not None:
                out[i] = dataclasses.replace(replies[i], result=bytes(data))
        return out

    async def _delete(self, ids: list[Any]) -> None:
        with contextlib.suppress(Exception):
            await self.redis.xdel(self.stream, *ids)
