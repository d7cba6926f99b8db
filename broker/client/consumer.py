"""Decoupled result consumption: trainer processes read a shared results stream as a consumer group.

Producers enqueue steps with ``Session.enqueue(step_id, results_stream="rollouts", ...)``; any
number of trainer processes run::

    async with ResultConsumer(fleet, "rollouts", group="trainers", consumer="trainer-1") as results:
        async for delivery in results:
            store(delivery.result)          # keyed by (session_id, step_id)
            await delivery.ack()            # after it is stored: at least once, handled once

or, a read at a time, ``deliveries = await results.read(count=64)`` then
``await results.ack_many(deliveries)`` once they are stored (one round trip for all of them).

Each result reaches the group at least once: a trainer that dies before acknowledging leaves its
entries pending, and another trainer claims them once they have been idle ``claim_idle_ms``.
Duplicates (a re-published or re-claimed result) are recognised by ``(session_id, step_id)``: the
group's acknowledgements are remembered, and already handled steps are acknowledged silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import ResponseError

from broker.client.fleet import MAX_BLOCK_MS, FleetClient
from broker.redis.aio import resolve
from broker.redis.backoff import REDIS_ERRORS, Backoff, raise_if_cancelling
from broker.redis.blobs import blob_key, read_blobs
from broker.redis.keys import CellKeys, check_stream_name
from broker.redis.layouts import LayoutError, ReplyEntry, handled_field
from schemas.errors import FleetError, InvalidRequestError
from schemas.messages import StepResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivery:
    consumer: ResultConsumer
    entry_id: str
    result: StepResult
    blob: str | None = None  # the reply blob the result was read from (broker/redis/blobs.py)

    @property
    def key(self) -> tuple[str, int]:
        return self.result.session_id, self.result.step_id

    async def ack(self) -> bool:
        """Acknowledge after storing; True the first time the group handles this step."""
        return await self.consumer.ack(self)


class ResultConsumer:
    """Reads one cell's results stream ``stream`` as ``group``. Results go to the stream of the
    session's cell, so with sessions in several cells run one consumer per cell (``cell``; default:
    the client's own cell, required for a client of every cell)."""

    def __init__(self, fleet: FleetClient, stream: str, *, group: str = "trainers", consumer: str | None = None,
                 claim_idle_ms: int = 30_000, handled_ttl_ms: int = 86_400_000, cell: str | None = None) -> None:
        check_stream_name(stream)
        check_stream_name(group)
        chosen = cell or fleet.cell
        if chosen is None:
            raise InvalidRequestError("a client of every cell reads one cell's results stream per consumer: "
                                      "pass cell=")
        if fleet.cell is not None and chosen != fleet.cell:
            raise InvalidRequestError(f"this client stays in cell {fleet.cell!r}; cell {chosen!r} refused")
        try:
            keys = CellKeys(fleet.config.prefix, chosen)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.cell: str = chosen
        self.fleet = fleet
        self.stream = stream
        self.group = group
        self.name = consumer or f"consumer-{uuid.uuid4().hex[:8]}"
        self.claim_idle_ms = claim_idle_ms
        self.handled_ttl_ms = handled_ttl_ms
        self._key = keys.reply(stream)
        self._handled = keys.handled(stream, group)
        self._cursor = "0"  # our own pending entries first (after a restart), then new ones
        self._next_claim = 0.0
        self._backoff = Backoff()  # between reads that failed (Redis unreachable)

    async def __aenter__(self) -> ResultConsumer:
        await self._create_group()
        return self

    async def _create_group(self) -> None:
        try:
            await self.fleet.redis.xgroup_create(self._key, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self, count: int = 64, block_ms: int = 1000) -> list[Delivery]:
        """Up to ``count`` results not yet handled by the group (may be empty after ``block_ms``:
        1 to MAX_BLOCK_MS; Redis reads 0 as "for ever"). While Redis cannot be reached the read is
        empty, after a wait of at most ``block_ms`` (logged, not raised); the next read starts from
        this consumer's pending entries, so a result a failed read delivered is not left behind."""
        if isinstance(block_ms, bool) or not isinstance(block_ms, int) or not 1 <= block_ms <= MAX_BLOCK_MS:
            raise ValueError(f"block_ms must be whole milliseconds in 1..{MAX_BLOCK_MS}, got {block_ms!r}")
        try:
            deliveries = await self._read(count, block_ms)
        except REDIS_ERRORS as exc:
            raise_if_cancelling()
            wait = min(self._backoff.take(), block_ms / 1000.0)
            log.warning("results stream %s could not be read (%s); reading again in %.2fs", self._key, exc, wait)
            self._cursor = "0"
            await asyncio.sleep(wait)
            return []
        self._backoff.reset()
        return deliveries

    async def _read(self, count: int, block_ms: int) -> list[Delivery]:
        try:
            raw = await self._claim(count) if time.monotonic() >= self._next_claim else []
            if not raw:
                resp: Any = await self.fleet.redis.xreadgroup(self.group, self.name, {self._key: self._cursor},
                                                              count=count, block=block_ms)
                raw = resp[0][1] if resp else []
                if self._cursor != ">":
                    self._cursor = raw[-1][0] if raw else ">"
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream or its group vanished (Redis lost its data): recreate them and read on.
            log.warning("results stream %s lost its group; recreating it", self._key)
            await self._create_group()
            return []
        return await self._deliveries(raw)

    async def _claim(self, count: int) -> list[Any]:
        """Take over entries another consumer left pending too long (it died or hangs)."""
        self._next_claim = time.monotonic() + self.claim_idle_ms / 2000.0
        resp: Any = await self.fleet.redis.xautoclaim(self._key, self.group, self.name,
                                                      min_idle_time=self.claim_idle_ms, start_id="0-0", count=count)
        return list(resp[1]) if resp else []

    async def _deliveries(self, raw: list[Any]) -> list[Delivery]:
        """The read's entries decoded, less the steps the group already handled (acknowledged here).
        Their result blobs, then their handled marks, are read in one round trip each, not one per
        entry: each would delay every entry behind it."""
        entries: list[tuple[str, ReplyEntry]] = []
        for entry_id, fields in raw:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            if not fields:
                continue
            try:
                entries.append((eid, ReplyEntry.from_fields(fields)))
            except LayoutError as exc:
                await self._drop(eid, exc)
        blobs = [blob_key(reply.result) for _, reply in entries]
        wanted = [key for key in blobs if key is not None]
        found = iter(await read_blobs(self.fleet.redis, wanted) if wanted else [])
        decoded: list[Delivery] = []
        for (eid, reply), blob in zip(entries, blobs, strict=True):
            data = None if blob is None else _raise_if_error(next(found))
            try:
                result = replace(reply, result=reply.result if data is None else bytes(data)).step_result(
                    self.fleet.limits)
            except (FleetError, LayoutError) as exc:  # undecodable, or its blob is gone
                await self._drop(eid, exc)
                continue
            decoded.append(Delivery(self, eid, result, blob))
        seen = await self._handled_already(decoded)
        duplicates = [d for d, handled in zip(decoded, seen, strict=True) if handled]
        if duplicates:  # of steps the group already handled: acknowledged, never delivered again
            await self.ack_many(duplicates)
        return [d for d, handled in zip(decoded, seen, strict=True) if not handled]

    async def _drop(self, entry_id: str, exc: Exception) -> None:
        log.error("dropping undecodable result %s: %s", entry_id, exc)
        await self.fleet.redis.xack(self._key, self.group, entry_id)

    async def _handled_already(self, deliveries: list[Delivery]) -> list[bool]:
        """Whether the group handled each successful step already (an error never counts as handled:
        a retried step may still commit later)."""
        fields = [handled_field(*d.key) for d in deliveries if d.result.ok]
        if len(fields) > 1:
            async with self.fleet.redis.pipeline(transaction=False) as pipe:
                for field in fields:
                    pipe.hexists(self._handled, field)
                marks = iter(await pipe.execute())
        else:
            marks = iter([await resolve(self.fleet.redis.hexists(self._handled, f)) for f in fields])
        return [bool(next(marks)) if d.result.ok else False for d in deliveries]

    async def ack(self, delivery: Delivery) -> bool:
        """Acknowledge ``delivery`` once stored; True the first time the group handles its step."""
        first = await self._ack_entry(delivery)
        if delivery.blob is not None and delivery.result.ok:  # handled by the group: no one claims it again
            await self.fleet.redis.delete(delivery.blob)
        return first

    async def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """:meth:`ack` for each delivery, together: the acknowledgements leave as one pipeline (the
        client's script calls made in one event-loop turn do) and the handled blobs go in one DEL,
        instead of a round trip or two per delivery. Every acknowledgement is attempted; the first
        error is raised after all have been tried."""
        outcomes = await asyncio.gather(*(self._ack_entry(d) for d in deliveries), return_exceptions=True)
        handled = [d.blob for d, outcome in zip(deliveries, outcomes, strict=True)
                   if d.blob is not None and d.result.ok and not isinstance(outcome, BaseException)]
        if handled:
            await self.fleet.redis.delete(*handled)
        firsts: list[bool] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            firsts.append(outcome)
        return firsts

    async def _ack_entry(self, delivery: Delivery) -> bool:
        r = delivery.result
        if not r.ok:  # errors are not "handled steps": a retried step may still commit later
            await self.fleet.redis.xack(self._key, self.group, delivery.entry_id)
            await self.fleet.redis.xdel(self._key, delivery.entry_id)
            return True
        scripts = self.fleet.link(self.cell).scripts
        return await scripts.ack_result(stream=self.stream, group=self.group, entry_id=delivery.entry_id,
                                        session_id=r.session_id, step_id=r.step_id,
                                        handled_ttl_ms=self.handled_ttl_ms)

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delivery]:
        while True:
            for delivery in await self.read():
                yield delivery
            await asyncio.sleep(0)


def _raise_if_error(value: Any) -> Any:
    """A pipelined read's answer, or its error raised (as the plain command would have)."""
    if isinstance(value, Exception):
        raise value
    return value
