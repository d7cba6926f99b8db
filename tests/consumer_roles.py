"""Producer and trainer processes for the decoupled-consumer test (run with python -m)."""

from __future__ import annotations

import asyncio
import sys

from broker import FleetClient
from broker.client.consumer import ResultConsumer


async def producer(url: str, prefix: str, sessions: int, steps: int) -> None:
    async with FleetClient(url, prefix=prefix) as fleet:
        handles = [await fleet.create_session(model="null-lm", mode="tokens") for _ in range(sessions)]
        for i in range(steps):
            for s in handles:
                ack = await s.enqueue(i, results_stream="rollouts", token_ids=[i, i + 1])
                assert ack.status == "queued", ack
            await asyncio.sleep(0.02)  # a producer that keeps feeding over time
    print("producer done", flush=True)


async def trainer(url: str, prefix: str, name: str) -> None:
    async with FleetClient(url, prefix=prefix) as fleet, \
            ResultConsumer(fleet, "rollouts", group="trainers", consumer=name, claim_idle_ms=500) as results:
        async for delivery in results:
            r = delivery.result
            key = f"{r.session_id}:{r.step_id}"
            # The trainer's store is keyed by (session_id, step_id): storing twice is recognised. Each
            # delivery is logged with the store write in one transaction (a kill cannot split them).
            pipe = fleet.redis.pipeline(transaction=True)
            pipe.hsetnx(f"{prefix}:store", key, name)
            pipe.rpush(f"{prefix}:deliveries", f"{key}:{name}")
            await pipe.execute()
            await delivery.ack()


if __name__ == "__main__":
    role, url, prefix, *rest = sys.argv[1:]
    if role == "producer":
        asyncio.run(producer(url, prefix, int(rest[0]), int(rest[1])))
    else:
        asyncio.run(trainer(url, prefix, rest[0]))
