"""Prototype, not project code: script calls made in the same event-loop turn leave as one pipeline.

The measured evidence for a proposed change to ``broker.scripts.Scripts``: today every concurrent
EVALSHA takes its own pooled connection, its own write and its own read. Here the calls gathered
while the loop runs the ready callbacks go out as one ``pipeline(transaction=False)`` of EVALSHA
(order kept; a NOSCRIPT falls back to the ordinary call, which loads the script).

    python -m bench.autopipe --redis-url URL --prefix P [--latent-shape 1,16,2,44,80]

runs a null-engine worker whose commits coalesce; :func:`coalesce_client` does the same for a
connected FleetClient's enqueues.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from broker import FleetClient
from broker.keys import CellKeys
from broker.scripts import Scripts
from workers.worker import Worker

_Pending = tuple[str, list[str], list[Any], "asyncio.Future[Any]"]


class CoalescingScripts(Scripts):
    def __init__(self, redis: Redis, keys: CellKeys) -> None:
        super().__init__(redis, keys)
        self._pending: list[_Pending] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            # Runs after the callbacks already ready: every call they make joins this batch.
            loop.call_soon(self._flush_soon)
        self._pending.append((name, keys, args, fut))
        return await fut

    def _flush_soon(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._flush(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush(self, batch: list[_Pending]) -> None:
        if len(batch) == 1:  # nothing to coalesce: the plain call, no pipeline bookkeeping
            name, keys, args, fut = batch[0]
            try:
                fut.set_result(await super()._call(name, keys, args))
            except Exception as exc:
                fut.set_exception(exc)
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, keys, args, _ in batch:
                    pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every caller sees it, as it would alone
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (name, keys, args, fut), result in zip(batch, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, NoScriptError):  # not loaded yet: the plain call loads it
                try:
                    fut.set_result(await super()._call(name, keys, args))
                except Exception as exc:
                    fut.set_exception(exc)
            elif isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)


def coalesce_client(fleet: FleetClient) -> None:
    """Swap a connected client's scripts for the coalescing ones (enqueue, control, create)."""
    fleet._scripts = CoalescingScripts(fleet.redis, fleet.keys)


def coalesce_worker(worker: Worker) -> None:
    """Swap a started worker's scripts for the coalescing ones."""
    scripts = CoalescingScripts(worker._redis_or_fail(), worker.keys)
    worker._scripts = scripts  # the worker's own calls (heartbeat, control)
    worker.executor.scripts = scripts  # commits and reports: the hot path


async def _serve(url: str, prefix: str, latent_shape: tuple[int, ...]) -> None:
    from workers.engines.null import NullEngine, NullEngineConfig
    from workers.settings import WorkerSettings

    worker = Worker(NullEngine(NullEngineConfig(latent_shape=latent_shape)),
                    WorkerSettings(redis_url=url, prefix=prefix))
    async with worker:
        coalesce_worker(worker)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        await worker.serve()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autopipe", description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--latent-shape", default="1,4")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.redis_url, args.prefix, tuple(int(x) for x in args.latent_shape.split(","))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
