"""How fast a decoupled trainer takes results off a shared results stream (``ResultConsumer``).

    python -m bench.consumer_read --size full

A private Redis holds a results stream filled beforehand with what workers publish for 64
sessions: tiny results (a float32 (1, 4) output, inline in the entry) or latents (float32
(1, 16, 2, 44, 80), 450 KB, each in its reply blob with a reference in the entry). One consumer
then takes them all, 64 entries per read, either reading only (``read``), acknowledging each
delivery in turn (``read + ack``: ``await delivery.ack()``) or each read's deliveries together
(``read + ack_many``). Reported: deliveries per second and this
process's CPU per delivery, best of the rounds (each round on a fresh stream). Not in ``run_all``:
it measures the consumer's own path, which the step benchmarks do not take.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.common import Row, module_main, new_prefix, private_redis
from broker import FleetClient
from broker.client.consumer import ResultConsumer
from broker.redis.blobs import BLOB_MARK
from broker.redis.layouts import ReplyEntry
from schemas.codec import encode
from schemas.results import StepResult

NAME = "consumer_read"
SHAPES = {"tiny": (1, 4), "latent": (1, 16, 2, 44, 80)}
SESSIONS = 64
READ_COUNT = 64
WAYS = ("read", "read + ack", "read + ack_many")


@dataclass(frozen=True)
class Size:
    entries: dict[str, int]  # per round, by kind
    rounds: int


SIZE = {"smoke": Size(entries={"tiny": 256, "latent": 64}, rounds=1),
        "full": Size(entries={"tiny": 8192, "latent": 1024}, rounds=5)}


async def fill(fleet: FleetClient, kind: str, entries: int) -> None:
    """The stream as workers leave it: entry i is step i // 64 of session i % 64."""
    stream = fleet.keys.reply("rollouts")
    output = np.random.default_rng(0).standard_normal(SHAPES[kind], dtype=np.float32)
    async with fleet.redis.pipeline(transaction=False) as pipe:
        for i in range(entries):
            step = i // SESSIONS
            result = StepResult(session_id=f"s{i % SESSIONS}", step_id=step, ok=True, committed_step_id=step,
                                output={"video_latent": output})
            data = encode(result.to_wire())
            if kind == "latent":
                blob = f"{stream}:blob:{i}"
                pipe.set(blob, data)
                data = BLOB_MARK + blob.encode()
            pipe.xadd(stream, ReplyEntry("step", f"job-{i}", step, data).to_fields())
        await pipe.execute()


async def take_all(fleet: FleetClient, entries: int, way: str) -> tuple[float, float]:
    """(deliveries/s, CPU µs per delivery) for one consumer taking ``entries`` deliveries."""
    async with ResultConsumer(fleet, "rollouts", group="trainers", consumer="trainer-1") as results:
        taken = 0
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(entries):  # bounded: every read but the first delivers
            if taken >= entries:
                break
            deliveries = await results.read(count=READ_COUNT, block_ms=100)
            if way == "read + ack":
                for delivery in deliveries:
                    await delivery.ack()
            elif way == "read + ack_many":
                await results.ack_many(deliveries)
            taken += len(deliveries)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if taken != entries:
        raise AssertionError(f"took {taken} of {entries} results")
    return entries / wall, 1e6 * cpu / entries


async def run(size: str) -> list[Row]:
    cfg = SIZE[size]
    rows: list[Row] = []
    with private_redis() as server:
        for kind in SHAPES:
            for way in WAYS:
                best: tuple[float, float] | None = None
                for _ in range(cfg.rounds):
                    async with FleetClient(server.url, prefix=new_prefix("cr")) as fleet:
                        await fill(fleet, kind, cfg.entries[kind])
                        rate, cpu_us = await take_all(fleet, cfg.entries[kind], way)
                    best = (rate, cpu_us) if best is None or rate > best[0] else best
                assert best is not None
                rows.append(Row(NAME, f"{kind} x{SESSIONS}", way, {
                    "deliveries_s": best[0], "cpu_us_per_delivery": best[1], "entries": cfg.entries[kind]}))
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
