"""A worker's result server: large results it committed, handed to their trainers directly.

Started with ``--serve-results HOST:PORT`` (``WorkerSettings.serve_results``; off by default). The
protocol and why are in schemas/results_wire.py. The worker still stages and commits every result in
Redis; this keeps the bytes of each large one (``STAGE_BYTES`` or more) it committed, for the
trainer to take once, so Redis never copies them out again:

- :meth:`HeldResults.hold` takes the bytes before the commit is sent (the reply can reach the
  trainer before the commit's answer reaches the worker); a request for them waits for the commit's
  answer, at most ``wait_s``;
- :meth:`HeldResults.settle` keeps them once the commit answered ``committed`` and drops them on any
  other answer, error or cancellation: a trainer that finds nothing here reads Redis;
- the first request takes them (a reply has one reader); what nobody took goes after ``hold_s`` (at
  the next hold or request), and the oldest go first once ``max_bytes`` would be passed: a
  committed result dropped so is *unclaimed* (counted: a trainer that cannot reach this port shows
  there, not as a request).

A connection that sends anything but requests is closed; one whose peer vanished is noticed by TCP
keepalive within seconds (broker/redis/connect.py tune_stream).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.redis.connect import tune_stream
from schemas.results_wire import (
    ProtocolError,
    format_address,
    parse_address,
    parse_host_or_address,
    read_request,
    response_head,
)

log = logging.getLogger(__name__)
WRITE_TIMEOUT_S = 10.0  # a trainer that stops reading an answer loses its connection


@dataclass
class _Held:
    data: bytes
    expires: float
    committed: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class HeldResults:
    """The large results of this worker's commits, by job id, until their trainer takes them."""

    def __init__(self, *, hold_s: float, max_bytes: int, wait_s: float = 2.0,
                 on_take: Callable[[bool], None] | None = None,
                 on_unclaimed: Callable[[], None] | None = None) -> None:
        self.hold_s = hold_s
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self.on_take = on_take  # told each request's outcome (served or not), for the worker's metrics
        self.on_unclaimed = on_unclaimed  # told of each committed result dropped before a trainer took it
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()  # oldest first
        self.bytes = 0
        self.served = 0  # results taken by a trainer
        self.missed = 0  # requests answered "not held"
        # committed results nobody took within hold_s (or pushed out by max_bytes): trainers that
        # cannot reach this worker's port, or that read Redis (direct_results=False)
        self.unclaimed = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, job_id: str, data: bytes) -> None:
        """Keep ``data`` for ``job_id`` (its commit is about to be sent): dropped unless
        :meth:`settle` says it committed. One larger than ``max_bytes`` is not kept."""
        now = asyncio.get_running_loop().time()
        self._expire(now, room=len(data))
        if len(data) > self.max_bytes:
            return
        self._drop(job_id)
        self._held[job_id] = _Held(data, now + self.hold_s)
        self.bytes += len(data)

    def settle(self, job_id: str, *, committed: bool) -> None:
        """The commit's outcome: kept for the trainer when committed, dropped otherwise."""
        held = self._held.get(job_id)
        if held is None:
            return
        if not held.committed.done():
            held.committed.set_result(committed)
        if not committed:
            self._drop(job_id)

    async def take(self, job_id: str) -> bytes | None:
        """The committed bytes of ``job_id``, once (None: not held here, not committed, or its
        commit not answered within ``wait_s``)."""
        self._expire(asyncio.get_running_loop().time(), room=0)
        held = self._held.get(job_id)
        if held is None:
            self._missed()
            return None
        if not held.committed.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.wait_s):
                    await asyncio.shield(held.committed)
        if not held.committed.done() or not held.committed.result() or self._held.get(job_id) is not held:
            self._missed()
            return None
        self._drop(job_id)
        self.served += 1
        if self.on_take is not None:
            self.on_take(True)
        return held.data

    def _missed(self) -> None:
        self.missed += 1
        if self.on_take is not None:
            self.on_take(False)

    def _drop(self, job_id: str) -> None:
        held = self._held.pop(job_id, None)
        if held is not None:
            self.bytes -= len(held.data)
            if not held.committed.done():
                held.committed.set_result(False)

    def _expire(self, now: float, *, room: int) -> None:
        """Drop what expired, then the oldest while ``room`` more bytes would pass ``max_bytes``;
        a committed one dropped so counts as unclaimed."""
        while self._held:
            job_id, held = next(iter(self._held.items()))
            if held.expires > now and self.bytes + room <= self.max_bytes:
                break
            if held.committed.done() and held.committed.result():
                self.unclaimed += 1
                if self.on_unclaimed is not None:
                    self.on_unclaimed()
            self._drop(job_id)


class ResultServer:
    """Serves :class:`HeldResults` at ``listen`` (``host:port``, port 0: a free one) and advertises
    ``advertise`` (``host:port``, or a host alone: with the port it listens on; default: the
    address it listens on, with the port it got)."""

    def __init__(self, held: HeldResults, listen: str, advertise: str | None = None) -> None:
        self.held = held
        self.host, self.port = parse_address(listen)
        # (host, port or None: the port it listens on); checked by WorkerSettings, which wants one
        # for a wildcard listen address
        self._advertise = None if advertise is None else parse_host_or_address(advertise)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        """Where trainers fetch from (after :meth:`start`)."""
        if self._advertise is None:
            return format_address(self.host, self.port)
        host, port = self._advertise
        return format_address(host, self.port if port is None else port)

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve results on {format_address(self.host, self.port)}: "
                                     f"{exc.strerror}") from exc
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving large results at %s", self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        tune_stream(writer)
        try:
            while True:
                job_id = await read_request(reader)
                data = await self.held.take(job_id)
                writer.write(response_head(data))
                if data is not None:
                    writer.write(data)
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the trainer closed, vanished or stopped reading
        except ProtocolError as exc:
            log.warning("result server: closing a connection that sent %s", exc)
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)
