"""The streaq anchor (a Redis Streams task queue): enqueue a step task, await its result.

``python -m bench.streaq_anchor --redis-url URL --queue Q`` runs one streaq worker; the bench
builds the same Worker object on the client side to enqueue. ``--concurrency`` is 256 here (streaq's
default is 16) so that it may run as many tasks at once as the fleet has sessions. streaq's defaults
otherwise (pickle serializer, results announced over pub/sub), except a connection pool large
enough for 256 concurrent result waits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from streaq import Worker

from bench.common import NullWorldSteps


def build(url: str, queue: str, concurrency: int = 256) -> tuple[Worker[Any], Any]:
    """The worker and its registered ``step`` task; client and worker build it alike."""
    # coredis pools default to 64 connections and every result wait holds a pub/sub connection:
    # 256 concurrent waiters would deadlock the client, so the pool is sized for them.
    worker: Worker[Any] = Worker(redis_url=url, queue_name=queue, concurrency=concurrency, handle_signals=True,
                                 redis_kwargs={"max_connections": 4 * concurrency})
    null_steps = NullWorldSteps()

    @worker.task(name="step", silent=True)
    async def step(session_id: str, step_id: int, inputs: dict[str, Any], latent_shape: list[int]) -> Any:
        return await null_steps(session_id, step_id, inputs, latent_shape)

    return worker, step


async def run_step(task: Any, session_id: str, step_id: int, inputs: dict[str, Any],
                   latent_shape: Sequence[int]) -> Any:
    enqueued = await task.enqueue(session_id, step_id, inputs, list(latent_shape))
    result = await enqueued.result(timeout=60)
    if not result.success:
        raise RuntimeError(f"streaq task failed: {result.exception}")
    return result.result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.streaq_anchor", description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args(argv)
    worker, _ = build(args.redis_url, args.queue, args.concurrency)
    worker.run_sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
