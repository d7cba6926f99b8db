"""Throughput, null engine: steps/s with 1, 2, 4 worker processes and 256 closed-loop sessions.

The fleet, arq and streaq on the same private Redis server, the same tiny world step, one trainer
process. Each session keeps one step in flight; steps finished inside the timed window count.
Anchor settings: arq poll delay 0.01 s (worker and result wait), max_jobs 256; streaq
concurrency 256; otherwise their defaults. ``cpu_us_*`` is the CPU each process spent per step in
the window (client = this trainer process). The fleet coalesces the
script calls of one event-loop turn into one pipeline (broker.redis.scripts).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench import arq_anchor, streaq_anchor
from bench.common import (
    TINY_SHAPE,
    Children,
    CpuMeter,
    Row,
    module_main,
    new_prefix,
    private_redis,
    start_fleet_workers,
    timed_window,
    world_inputs,
)
from broker import FleetClient
from broker.redis.embedded import RedisServer

NAME = "throughput"
SESSIONS = 256


@dataclass(frozen=True)
class Size:
    workers: tuple[int, ...]
    window_s: float
    warmup_s: float


SIZE = {"smoke": Size(workers=(1, 2), window_s=0.5, warmup_s=0.3),
        "full": Size(workers=(1, 2, 4), window_s=4.0, warmup_s=1.0)}

def _meter(server: RedisServer, children: Children) -> CpuMeter:
    redis_pid = [server.process.pid] if server.process is not None else []
    return CpuMeter({"workers": [p.pid for p in children.procs], "redis": redis_pid})


async def fleet_row(server: RedisServer, workers: int, size: Size) -> Row:
    prefix = new_prefix("tp")
    with Children() as children:
        await start_fleet_workers(children, server.url, prefix, count=workers)
        async with FleetClient(server.url, prefix=prefix) as fleet:
            sessions = await asyncio.gather(*(fleet.create_session("null-world", "world_model_env")
                                              for _ in range(SESSIONS)))

            async def step(session: Any, k: int) -> None:
                result = await session.step(k, **world_inputs(k))
                if not result.ok:
                    raise RuntimeError(result.error)

            return await timed_window(NAME, sessions, step, size.warmup_s, size.window_s, _meter(server, children))


async def arq_row(server: RedisServer, workers: int, size: Size) -> Row:
    url, queue = server.url, new_prefix("tparq")
    with Children() as children:
        for _ in range(workers):
            children.spawn([sys.executable, "-m", "bench.arq_anchor", "--redis-url", url, "--queue", queue])
        pool = await arq_anchor.connect(url, queue)
        try:
            async def step(sid: Any, k: int) -> None:
                await arq_anchor.run_step(pool, queue, sid, k, world_inputs(k), TINY_SHAPE)

            await step("ready", 0)  # waits until a worker runs it
            children.check_alive()
            sids = [f"{queue}-{i}" for i in range(SESSIONS)]
            return await timed_window(NAME, sids, step, size.warmup_s, size.window_s, _meter(server, children))
        finally:
            await pool.aclose()


async def streaq_row(server: RedisServer, workers: int, size: Size) -> Row:
    url, queue = server.url, new_prefix("tpsq")
    with Children() as children:
        for _ in range(workers):
            children.spawn([sys.executable, "-m", "bench.streaq_anchor", "--redis-url", url, "--queue", queue])
        client, task = streaq_anchor.build(url, queue)
        async with client:
            async def step(sid: Any, k: int) -> None:
                await streaq_anchor.run_step(task, sid, k, world_inputs(k), TINY_SHAPE)

            await asyncio.wait_for(step("ready", 0), 60)
            children.check_alive()
            sids = [f"{queue}-{i}" for i in range(SESSIONS)]
            return await timed_window(NAME, sids, step, size.warmup_s, size.window_s, _meter(server, children))


SYSTEMS: dict[str, Callable[[RedisServer, int, Size], Awaitable[Row]]] = {
    "fleet": fleet_row, "arq": arq_row, "streaq": streaq_row,
}


def ratios(rows: Sequence[Row]) -> list[Row]:
    """fleet / anchor steps/s per worker count: above 1 means the fleet is faster."""
    by = {(r.system, r.case): r.values["steps_s"] for r in rows}
    out: list[Row] = []
    for case in dict.fromkeys(r.case for r in rows):
        for fleet_system in ("fleet",):
            fleet = by.get((fleet_system, case), 0.0)
            values = {anchor: fleet / by[(anchor, case)] for anchor in ("arq", "streaq")
                      if by.get((anchor, case), 0.0) > 0}
            out.append(Row(NAME, case, f"{fleet_system} speedup vs", values, "x"))
    return out


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    rows: list[Row] = []
    with private_redis() as server:
        for workers in sz.workers:
            for system, measure in SYSTEMS.items():
                row = await measure(server, workers, sz)
                row.system, row.case = system, f"{workers} workers x {SESSIONS} sessions"
                row.values["workers"] = float(workers)
                rows.append(row)
    return rows + ratios(rows)


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
