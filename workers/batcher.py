"""Continuous batching per model: requests that arrive while the engine is busy form the next batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from workers.engines.base import Engine, EngineOutput, EngineRequest
from workers.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

_Item = tuple[EngineRequest, "asyncio.Future[EngineOutput]"]


class Batcher:
    def __init__(self, engine: Engine, model: str, *, max_batch: int, wait_ms: float = 0.0,
                 metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model = model
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000.0
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0

    async def run(self, request: EngineRequest) -> EngineOutput:
        """Run one request in the next batch; raises what the engine raised for it."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"batcher:{self.model}")
        fut: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((request, fut))
        return await fut

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _collect(self) -> list[_Item]:
        batch = [await self._queue.get()]
        # One yield lets lanes that became ready together join this batch.
        await asyncio.sleep(self.wait_s)
        while len(batch) < self.max_batch and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._collect()
            live = [(req, fut) for req, fut in batch if not fut.done()]
            if not live:
                continue
            try:
                outs = await self.engine.run_batch(self.model, [req for req, _ in live])
                if len(outs) != len(live):
                    raise RuntimeError(f"engine returned {len(outs)} outputs for {len(live)} requests")
            except Exception as exc:  # the whole batch failed: every request sees the cause
                log.warning("batch of %d for %s failed: %s", len(live), self.model, exc)
                outs = [exc] * len(live)
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
