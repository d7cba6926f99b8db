"""One pool size of bench.placement_scale, measured in a child process against the checkout first
on its ``PYTHONPATH``: the current one, or an earlier revision's worktree.

It imports nothing of ``bench/`` (an earlier revision may not have this code) and uses what every
revision since the per-worker capacity has: ``open_redis``, ``Scripts.register``, ``Scripts.create`` and
``broker.ops.failover.fail_over``. Against an empty private Redis: one worker with ``--moved``
sessions, then ``--workers`` more in the same pool; ``--creates`` session creates (one at a time,
each placed over the whole pool); then the first worker hands its sessions over (a drain's
``fail_over``, reason ``handover``: an expired worker's failover takes the same path). Prints one
JSON line: the master's time per create (``EVALSHA``'s usec per call in ``INFO commandstats``), the
commands per create, and the handover's wall time and commands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

MODE, MODEL = "tokens", "null-lm"
LEASE_MS = 600_000  # nobody beats in this process: every worker stays live for the measurement


async def _commands(redis: Any) -> tuple[int, dict[str, Any]]:
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values()), stats


async def measure(args: argparse.Namespace) -> dict[str, float]:
    from broker.ops.failover import fail_over  # the checkout under measurement
    from broker.redis.connect import open_redis
    from broker.redis.keys import CellKeys
    from broker.redis.scripts import Scripts

    redis = open_redis(args.redis_url)
    scripts = Scripts(redis, CellKeys(args.prefix))
    pool = scripts.keys.pool(MODE, MODEL)
    try:
        async def register(worker_id: str, capacity: int) -> None:
            await scripts.register(worker_id, capacity=capacity, pools=[pool], ttl_ms=LEASE_MS,
                                   fields={"state": "active"})

        async def create() -> None:
            await scripts.create(uuid.uuid4().hex, MODE, MODEL, lease_ms=LEASE_MS, retention="full", result_window=1)

        await register("leaving", args.moved)
        for _ in range(args.moved):
            await create()
        for i in range(args.workers):
            await register(f"w{i:05d}", args.creates + args.moved)
        await redis.config_resetstat()
        for _ in range(args.creates):
            await create()
        calls, stats = await _commands(redis)
        create_us = float(stats["cmdstat_evalsha"]["usec"]) / args.creates
        await redis.config_resetstat()
        started = time.perf_counter()
        report = await fail_over(scripts, "leaving", lease_ms=LEASE_MS, reason="handover")
        handover_ms = (time.perf_counter() - started) * 1000.0
        handover_calls, _ = await _commands(redis)
        if len(report.moved) != args.moved:
            raise RuntimeError(f"the handover moved {len(report.moved)} of {args.moved} sessions")
        return {"create_us": create_us, "create_commands": calls / args.creates, "handover_ms": handover_ms,
                "handover_commands": float(handover_calls)}
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--creates", type=int, required=True)
    parser.add_argument("--moved", type=int, required=True)
    print(json.dumps(asyncio.run(measure(parser.parse_args()))))


if __name__ == "__main__":
    main()
