"""The arq anchor: enqueue a step job, wait for its result. The job runs the same null engine.

``python -m bench.arq_anchor --redis-url URL --queue Q`` runs one arq worker. arq polls: the
worker every ``--poll-delay`` s (0.01 here, arq's default is 0.5) and the client's
``Job.result(poll_delay=...)`` likewise; ``--max-jobs`` (256 here, default 10) lets it run as many
jobs at once as the fleet has sessions. arq's default serializer (pickle) is kept.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from arq import create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.worker import Worker, func

from bench.common import NullWorldSteps

POLL_DELAY_S = 0.01


async def step(ctx: dict[str, Any], session_id: str, step_id: int, inputs: dict[str, Any],
               latent_shape: list[int]) -> dict[str, Any]:
    """One world step through a NullEngine of the requested latent shape (one engine per shape)."""
    steps: NullWorldSteps = ctx.setdefault("steps", NullWorldSteps())
    return await steps(session_id, step_id, inputs, latent_shape)


async def connect(url: str, queue: str) -> ArqRedis:
    return await create_pool(RedisSettings.from_dsn(url), default_queue_name=queue)


async def run_step(pool: ArqRedis, queue: str, session_id: str, step_id: int, inputs: dict[str, Any],
                   latent_shape: Sequence[int]) -> Any:
    job = await pool.enqueue_job("step", session_id, step_id, inputs, list(latent_shape), _queue_name=queue)
    if job is None:  # arq returns None only for a duplicate job id, which uuid ids never are
        raise RuntimeError("arq refused the job")
    return await job.result(timeout=60, poll_delay=POLL_DELAY_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.arq_anchor", description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--poll-delay", type=float, default=POLL_DELAY_S)
    parser.add_argument("--max-jobs", type=int, default=256)
    args = parser.parse_args(argv)
    worker = Worker(functions=[func(step, name="step")], queue_name=args.queue,
                    redis_settings=RedisSettings.from_dsn(args.redis_url), poll_delay=args.poll_delay,
                    max_jobs=args.max_jobs, keep_result=120, handle_signals=True, log_results=False)
    worker.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
