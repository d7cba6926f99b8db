"""The trainer side of a reply stream: one reader task that resolves waiting futures by job id."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from redis.asyncio import Redis

from broker.client.direct import DirectFetcher
from broker.redis.backoff import REDIS_ERRORS, Backoff, cancel_and_wait
from broker.redis.blobs import IN_PLACE_READER_TTL_MS, blob_key, in_place_keys, mark_read, read_reply_blobs
from broker.redis.connect import cluster_client_errors
from broker.redis.layouts import ReplyEntry

log = logging.getLogger(__name__)
DELETE_WAIT_S = 1.0  # on stop, how long deletes of entries already read may take to finish
TRIM_INTERVAL_S = 0.05  # entries read wait at most this long (or one idle block) for the XTRIM that deletes them


class ReplyReader:
    """Reads one reply stream and hands each entry to the future registered for its job id.

    Entries are deleted once read: one ``XTRIM MINID`` past the last entry read, at most every
    ``trim_interval_s`` (and when a read finds nothing new, and on stop), deletes every entry read
    since the one before, instead of an ``XDEL`` per read. The stream holds what no reader has seen
    yet and what it read in the last moment. One reader reads a stream, in the order of its ids,
    so nothing below the last id read is unread. Unknown job ids (a re-published duplicate, a caller
    that gave up) are dropped.

    Given ``in_place`` (the stream's ``CellKeys.in_place_reader``), it keeps that key standing while
    it runs (renewed every third of its TTL, deleted on stop): commits then reply with large results
    in place, with no copy (broker/redis/blobs.py), which ``_resolved`` reads. Without it, large
    results come as copies, which it reads as well.
    """

    def __init__(self, redis: Redis, stream: str, *, in_place: str | None = None, block_ms: int = 1000,
                 batch: int = 512, trim_interval_s: float = TRIM_INTERVAL_S,
                 direct: DirectFetcher | None = None) -> None:
        self.redis = redis
        self.stream = stream
        self.in_place = in_place
        self.direct = direct  # fetches in-place results from the worker that committed them first
        self._sources: dict[str, str] = {}  # job id -> the worker it was sent to (for ``direct``)
        self.block_ms = block_ms
        self.batch = batch
        self.trim_interval_s = trim_interval_s
        self._untrimmed = False  # entries up to _last_id read and not yet trimmed
        self._trimmed_at = float("-inf")  # the loop clock of the last trim sent
        self._waiters: dict[str, asyncio.Future[ReplyEntry]] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_id = b"0-0"
        self._deletes: set[asyncio.Task[None]] = set()
        self._marks: set[asyncio.Task[None]] = set()  # in-place replies fetched directly, marked read
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_place_due = float("-inf")  # the loop clock at which in_place is renewed

    def expect(self, job_id: str, *, worker_id: str | None = None) -> asyncio.Future[ReplyEntry]:
        """A future for the reply of ``job_id``; ``worker_id``: the worker the job is sent to (see
        :meth:`sent_to`)."""
        # The reader task's loop (the one that resolves the future), not a lookup per step.
        loop = self._loop if self._task is not None and self._loop is not None else asyncio.get_running_loop()
        fut: asyncio.Future[ReplyEntry] = loop.create_future()
        self._waiters[job_id] = fut
        if worker_id is not None and self.direct is not None:
            self._sources[job_id] = worker_id
        return fut

    def sent_to(self, job_id: str, worker_id: str) -> None:
        """The worker ``job_id`` went to (after a move): a large result is asked of it first."""
        if self.direct is not None and job_id in self._waiters:
            self._sources[job_id] = worker_id

    def forget(self, job_id: str) -> None:
        self._waiters.pop(job_id, None)
        self._sources.pop(job_id, None)

    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name=f"reply-reader:{self.stream}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self._finish_deletes()
        if self.in_place is not None and self._in_place_due != float("-inf"):  # later commits copy again
            with contextlib.suppress(Exception):  # a key left behind expires with its TTL
                async with asyncio.timeout(DELETE_WAIT_S):
                    await self.redis.delete(self.in_place)
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        self._waiters.clear()
        self._sources.clear()
        if self.direct is not None:
            await self.direct.close()

    async def _finish_deletes(self) -> None:
        """What was read last leaves with the reader, after a trim still in flight. A trim (or a
        mark of replies read) still in flight would outlive the connection pool its owner closes
        next, and open a fresh connection nobody closes: let it finish (briefly), cancel what is
        left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DELETE_WAIT_S
        for _ in range(2):
            if self._deletes:
                await asyncio.wait(set(self._deletes), timeout=max(0.0, deadline - loop.time()))
            if not self._deletes:
                self._trim(force=True)
        if self._marks:
            await asyncio.wait(set(self._marks), timeout=max(0.0, deadline - loop.time()))
        for task in [*self._deletes, *self._marks]:
            task.cancel()
        await asyncio.gather(*self._deletes, *self._marks, return_exceptions=True)

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            try:
                await self._renew_in_place()
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
                self._trim(force=False)
            else:  # nothing new for a whole block: what was read leaves now
                self._trim(force=True)

    async def _renew_in_place(self) -> None:
        """Say (again, when due) that this reader reads large results in place. A renewal that fails
        is retried with the read; the key outlasts it by two thirds of its TTL, and a commit that
        finds it gone copies the result instead, which this reader reads as well."""
        now = asyncio.get_running_loop().time()
        if self.in_place is None or now < self._in_place_due:
            return
        await self.redis.set(self.in_place, b"1", px=IN_PLACE_READER_TTL_MS)
        self._in_place_due = now + IN_PLACE_READER_TTL_MS / 3000

    async def _dispatch(self, items: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for reply in await self._resolved([ReplyEntry.from_fields(fields) for _, fields in items]):
            self._sources.pop(reply.job_id, None)
            fut = self._waiters.pop(reply.job_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
        self._last_id = items[-1][0]
        self._untrimmed = True

    def _trim(self, *, force: bool) -> None:
        """Fire-and-forget: delete every entry up to the last one read, unless a trim is still in
        flight or (``force`` aside) the last one left less than ``trim_interval_s`` ago."""
        if not self._untrimmed or self._deletes:
            return
        now = asyncio.get_running_loop().time()
        if not force and now - self._trimmed_at < self.trim_interval_s:
            return
        self._untrimmed, self._trimmed_at = False, now
        task = asyncio.create_task(self._delete_through(self._last_id))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _resolved(self, replies: list[ReplyEntry]) -> list[ReplyEntry]:
        """The entries with their result blobs read (broker/redis/blobs.py read_reply_blobs): a reply
        blob deleted (this reader is each one's one reader, as it is the entry's), an in-place one
        read where the log keeps it and marked read. The blobs of one read leave as one pipeline
        (one round trip, not one per entry: each would delay the replies behind it). A blob that is
        gone, or Redis unreachable for that read, leaves the reference, which decodes as
        step_already_committed."""
        wanted = [(i, reply.result) for i, reply in enumerate(replies) if blob_key(reply.result) is not None]
        if not wanted:
            return replies
        out = list(replies)
        if self.direct is not None and self._sources:
            wanted = await self._fetched_directly(wanted, out)
            if not wanted:
                return out
        failures = REDIS_ERRORS + cluster_client_errors(self.redis)
        try:
            values = await read_reply_blobs(self.redis, [ref for _, ref in wanted])
        except failures as exc:
            log.warning("result blobs of %d replies unreadable: %s", len(wanted), exc)
            return out
        for (i, ref), data in zip(wanted, values, strict=True):
            if isinstance(data, Exception):
                log.warning("result blob %s of job %s unreadable: %s", blob_key(ref), replies[i].job_id, data)
            elif data is not None:
                out[i] = dataclasses.replace(replies[i], result=bytes(data))
        return out

    async def _fetched_directly(self, wanted: list[tuple[int, bytes]],
                                out: list[ReplyEntry]) -> list[tuple[int, bytes]]:
        """Fetch the in-place results of ``wanted`` from the workers their jobs went to
        (broker/client/direct.py), into ``out``; returns those left for Redis. A fetched result's
        reply is marked read in Redis off the reply's path (:func:`mark_read`)."""
        assert self.direct is not None
        direct = self.direct
        by_worker: dict[str, list[tuple[int, bytes]]] = {}
        for i, ref in wanted:
            worker_id = self._sources.get(out[i].job_id)
            if worker_id is not None and direct.may_serve(worker_id) and in_place_keys(ref) is not None:
                by_worker.setdefault(worker_id, []).append((i, ref))
        if not by_worker:
            return wanted
        got = await asyncio.gather(*(direct.fetch(worker_id, [out[i].job_id for i, _ in jobs])
                                     for worker_id, jobs in by_worker.items()))
        served: list[bytes] = []
        done: set[int] = set()
        for jobs, answers in zip(by_worker.values(), got, strict=True):
            for (i, ref), data in zip(jobs, answers, strict=True):
                if data is not None:
                    out[i] = dataclasses.replace(out[i], result=data)
                    served.append(ref)
                    done.add(i)
        if served:
            task = asyncio.create_task(mark_read(self.redis, served))
            self._marks.add(task)
            task.add_done_callback(self._marks.discard)
        return [(i, ref) for i, ref in wanted if i not in done]

    async def _delete_through(self, last_id: bytes) -> None:
        """``XTRIM MINID`` (exact) just past ``last_id``: every entry up to it goes, none after it. A
        trim that fails (Redis unreachable) leaves them for the next one."""
        ms, _, seq = (last_id.decode() if isinstance(last_id, bytes) else str(last_id)).partition("-")
        try:
            await self.redis.xtrim(self.stream, minid=f"{int(ms)}-{int(seq) + 1}", approximate=False)
        except Exception:
            self._untrimmed = True
