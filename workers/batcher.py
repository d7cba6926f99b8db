"""Continuous batching per model: requests that arrive while the engine is busy form the next batch.

When more requests wait than fit in a batch, interactive ones go first (schemas/sharing.py): an
evaluation step never waits behind a queue of bulk training steps. Within a class, arrival order.

An engine that only fans a batch out to a server batching on its own (vLLM's continuous batching)
takes several batches at once (``Engine.batches_in_flight``): otherwise a step that finished early
waits for the slowest of its batch before the next batch may start. A session's steps never overlap
either way: the worker runs them one after the other (its per-session lanes).

Engine time comes before commit work: when a batch finishes, the next one (if its requests wait)
is started before the finished batch's steps are answered, so an engine that runs one forward at
a time (a GPU) is not idle while the event loop encodes and commits the results.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from broker.redis.backoff import cancel_and_wait
from schemas.sharing import DEFAULT_PRIORITY, Priority
from workers.engines.base import Engine, EngineOutput, EngineRequest
from workers.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

_Item = tuple[EngineRequest, "asyncio.Future[EngineOutput]"]


class Batcher:
    def __init__(self, engine: Engine, model: str, *, max_batch: int, wait_ms: float = 0.0,
                 metrics: WorkerMetrics | None = None, in_flight: int = 1) -> None:
        if in_flight < 1:
            raise ValueError(f"batches in flight must be at least 1, got {in_flight}")
        self.engine = engine
        self.metrics = metrics
        self.model = model
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000.0
        # One FIFO per priority class, the first class first; _arrived is set while any holds one.
        self._queues: dict[Priority, collections.deque[_Item]] = {
            p: collections.deque() for p in sorted(Priority, key=lambda p: p.rank)}
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(in_flight)
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0

    async def run(self, request: EngineRequest, priority: Priority = DEFAULT_PRIORITY) -> EngineOutput:
        """Run one request in the next batch with room for its class; raises what the engine raised
        for it."""
        task = self._task
        if task is None:  # the loop looked up once, not per request: in Python 3.11 a getpid syscall
            task = self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher:{self.model}")
        fut: asyncio.Future[EngineOutput] = task.get_loop().create_future()
        self._queues[priority].append((request, fut))
        self._arrived.set()
        return await fut

    def waiting(self, priority: Priority | None = None) -> int:
        """Requests waiting for a batch (of one class, or of all)."""
        return sum(len(q) for p, q in self._queues.items() if priority in (None, p))

    async def close(self) -> None:
        tasks = [*self._running, *([self._task] if self._task is not None else [])]
        await cancel_and_wait(*tasks)
        self._task = None

    async def _collect(self) -> list[_Item]:
        while not self.waiting():
            self._arrived.clear()
            await self._arrived.wait()
        # One yield lets lanes that became ready together join this batch (and an interactive
        # request that arrives meanwhile still goes first). A full batch starts at once: nothing
        # could join it, and the yield would run the last batch's commit work before this forward.
        if self.waiting() < self.max_batch:
            await asyncio.sleep(self.wait_s)
        batch: list[_Item] = []
        for queue in self._queues.values():
            while queue and len(batch) < self.max_batch:
                batch.append(queue.popleft())
        return batch

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()  # a batch is collected only once a slot is free to run it
            try:
                batch = await self._collect()
            except BaseException:
                self._slots.release()
                raise
            live = [(req, fut) for req, fut in batch if not fut.done()]
            if not live:
                self._slots.release()
                continue
            task = asyncio.create_task(self._run(live), name=f"batch:{self.model}")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, live: list[_Item]) -> None:
        try:
            outs = await self.engine.run_batch(self.model, [req for req, _ in live])
            if len(outs) != len(live):
                raise RuntimeError(f"engine returned {len(outs)} outputs for {len(live)} requests")
        except Exception as exc:  # the whole batch failed: every request sees the cause
            log.warning("batch of %d for %s failed: %s", len(live), self.model, exc)
            outs = [exc] * len(live)
        finally:
            self._slots.release()
        # Let the loop start the next batch (its engine call runs up to its first await, so the
        # device is busy again) before this batch's steps wake up and do their commit work on the
        # same event loop: the device does not idle through it.
        await asyncio.sleep(0)
        self.batches += 1
        self.items += len(live)
        if self.metrics is not None:
            self.metrics.batch(self.model, len(live))
        for (_, fut), out in zip(live, outs, strict=True):
            if fut.done():
                continue
            if isinstance(out, BaseException):
                fut.set_exception(out)
            else:
                fut.set_result(out)
