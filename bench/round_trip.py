"""Step round trip, null engine: p50/p99/max with 1 and 64 concurrent sessions.

Systems: the fleet (a worker process from ``python -m cli.main worker --engine null``, the
trainer on FleetClient), the direct HTTP anchor (FastAPI + uvicorn, one POST per step, httpx
pool), arq (enqueue and wait; poll delay 0.01 s on both sides) and the floor, a Redis PING from
asyncio redis-py (also 64 PINGs as one pipeline). Fleet workers run with glibc malloc tuned
(workers.runner.tune_malloc) and coalesce script calls into pipelines (broker.redis.scripts).
Results: a tiny one (null engine default, float32 (1, 4)) and the (1, 16, 2, 44, 80) float32
latent. Every session runs closed loop: next step when the last returned. The latent cases run
again as ``fleet (one hop)``: the worker started with ``--serve-results``, so the trainer fetches
each latent from it instead of from Redis (schemas/results_wire.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from bench import arq_anchor
from bench.common import (
    LATENT_SHAPE,
    TINY_SHAPE,
    Children,
    Latencies,
    Row,
    StepFn,
    closed_loop,
    module_main,
    new_prefix,
    private_redis,
    start_fleet_workers,
    wait_for,
    world_inputs,
)
from bench.http_anchor import HttpRollout
from bench.trainers import Drive, drive_all, merged_latencies, split
from broker import FleetClient
from broker.redis.connect import open_redis
from broker.redis.embedded import free_port

NAME = "round_trip"
ONE_HOP = "fleet (one hop)"  # workers started with --serve-results: large results skip Redis's second copy
CONCURRENCY = (1, 64)
SHAPES = {"tiny": TINY_SHAPE, "latent": LATENT_SHAPE}


@dataclass(frozen=True)
class Size:
    steps: dict[str, int]  # measured steps per (system, concurrency), per result shape
    polled_steps: int  # arq polls every 10 ms: fewer steps keep the run short
    warmup: int  # steps per session before measuring (connections opened, buffers grown)
    trainers: tuple[int, ...]  # the 64-session fleet cases again from this many trainer processes


SIZE = {"smoke": Size(steps={"tiny": 128, "latent": 128}, polled_steps=48, warmup=2, trainers=(2,)),
        "full": Size(steps={"tiny": 3072, "latent": 1536}, polled_steps=640, warmup=5, trainers=(4,))}

async def measure(system: str, shape_name: str, handles: Sequence[Any], size: Size, step: StepFn,
                  steps: int) -> Row:
    await closed_loop(handles, size.warmup * len(handles), 0, step)
    lat = await closed_loop(handles, steps, size.warmup, step)
    return Row(NAME, f"{shape_name} x{len(handles)}", system, lat.summary(), "ms", lat.first_error)


# --------------------------------------------------------------------------- systems


async def ping_floor(url: str, size: Size) -> list[Row]:
    redis = open_redis(url, max_connections=max(CONCURRENCY))
    try:
        async def ping(_: Any, __: int) -> None:
            await redis.ping()

        rows = [await measure("redis PING", "floor", list(range(n)), size, ping, size.steps["tiny"])
                for n in CONCURRENCY]
        rows.append(await pipelined_pings(redis, max(CONCURRENCY), size.steps["tiny"]))
        return rows
    finally:
        await redis.aclose()


async def pipelined_pings(redis: Redis, n: int, total: int) -> Row:
    """n PINGs sent as one pipeline, timed per round: the floor if the n sessions' commands were
    coalesced into one write and one read instead of n concurrent single-command round trips."""
    lat = Latencies()
    for _ in range(max(2, total // n)):
        t0 = time.perf_counter()
        async with redis.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.ping()
            await pipe.execute()
        lat.samples_ms += [(time.perf_counter() - t0) * 1000.0] * n
    return Row(NAME, f"floor x{n}", "redis PING pipelined", lat.summary(), "ms")


async def _fleet_step(session: Any, k: int) -> None:
    result = await session.step(k, **world_inputs(k))
    if not result.ok:
        raise RuntimeError(result.error)


async def fleet_rows(url: str, size: Size, *, shapes: dict[str, tuple[int, ...]] = SHAPES,
                     system: str = "fleet", env: dict[str, str] | None = None,
                     extra: Sequence[str] = ()) -> list[Row]:
    rows: list[Row] = []
    for shape_name, shape in shapes.items():
        prefix = new_prefix("rt")
        with Children() as children:
            await start_fleet_workers(children, url, prefix, latent_shape=shape, env=env, extra=extra)
            async with FleetClient(url, prefix=prefix) as fleet:
                for n in CONCURRENCY:
                    sessions = [await fleet.create_session("null-world", "world_model_env") for _ in range(n)]
                    rows.append(await measure(system, shape_name, sessions, size, _fleet_step,
                                              size.steps[shape_name]))
                    rows[-1].values["trainers"] = 1.0
            if system == "fleet":
                rows += [await trainers_row(url, prefix, shape_name, size, t) for t in size.trainers]
    return rows


async def trainers_row(url: str, prefix: str, shape_name: str, size: Size, trainers: int) -> Row:
    """The 64-session case with its sessions spread over ``trainers`` trainer processes."""
    n = max(CONCURRENCY)
    per_session = max(1, size.steps[shape_name] // n)
    drives = [Drive("fleet", url, prefix, count, f"t{i}", warmup=size.warmup, steps=per_session)
              for i, count in enumerate(split(n, trainers))]
    lat = merged_latencies(await drive_all(drives))
    return Row(NAME, f"{shape_name} x{n}", f"fleet ({trainers} trainers)",
               {**lat.summary(), "trainers": float(trainers)}, "ms", lat.first_error)


async def http_rows(size: Size) -> list[Row]:
    rows: list[Row] = []
    for shape_name, shape in SHAPES.items():
        port = free_port()
        with Children() as children:
            children.spawn([sys.executable, "-m", "bench.http_anchor", "--port", str(port),
                            "--latent-shape", ",".join(map(str, shape))])
            client = HttpRollout(f"http://127.0.0.1:{port}", pool=max(CONCURRENCY))
            try:
                await wait_for(client.ready, children, "http anchor")

                async def step(sid: Any, k: int, client: HttpRollout = client) -> None:
                    await client.step(sid, k, world_inputs(k))

                for n in CONCURRENCY:
                    sids = [await client.create_session("null-world") for _ in range(n)]
                    rows.append(await measure("http", shape_name, sids, size, step, size.steps[shape_name]))
            finally:
                await client.aclose()
    return rows


async def arq_rows(url: str, size: Size) -> list[Row]:
    rows: list[Row] = []
    queue = new_prefix("arq")
    with Children() as children:
        children.spawn([sys.executable, "-m", "bench.arq_anchor", "--redis-url", url, "--queue", queue])
        pool = await arq_anchor.connect(url, queue)
        try:
            for shape_name, shape in SHAPES.items():
                async def step(sid: Any, k: int, shape: Sequence[int] = shape) -> None:
                    await arq_anchor.run_step(pool, queue, sid, k, world_inputs(k), shape)

                await wait_for(lambda: _true(step("ready", 0)), children, "arq worker")
                for n in CONCURRENCY:
                    sids = [f"{queue}-{shape_name}-{n}-{i}" for i in range(n)]
                    rows.append(await measure("arq", shape_name, sids, size, step, size.polled_steps))
        finally:
            await pool.aclose()
    return rows


async def _true(coro: Awaitable[Any]) -> bool:
    await coro
    return True


def ratios(rows: Sequence[Row]) -> list[Row]:
    """anchor / fleet for each case: above 1 means the fleet is faster."""
    by = {(r.system, r.case): r.values for r in rows}
    out: list[Row] = []
    fleets = [s for s in dict.fromkeys(r.system for r in rows) if s == "fleet" or s.startswith("fleet (")]
    for anchor in ("http", "arq"):
        for system in fleets:
            for case in dict.fromkeys(r.case for r in rows if r.system == system):
                fleet, other = by.get((system, case)), by.get((anchor, case))
                if fleet and other:
                    values = {k: other[k] / fleet[k] for k in ("p50", "p99") if fleet[k] > 0}
                    out.append(Row(NAME, case, f"{system} speedup vs {anchor}", values, "x"))
    return out


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    with private_redis() as server:
        rows = await ping_floor(server.url, sz)
        rows += await fleet_rows(server.url, sz)
        # The latent again with the worker handing results to the trainer itself (schemas/results_wire.py)
        rows += await fleet_rows(server.url, sz, shapes={"latent": LATENT_SHAPE}, system=ONE_HOP,
                                 extra=["--serve-results", "127.0.0.1:0"])
        rows += await http_rows(sz)
        rows += await arq_rows(server.url, sz)
    for row in rows:
        if row.system == "arq":
            row.note = "arq poll_delay 0.01 s (worker and result)"
    return rows + ratios(rows)


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
