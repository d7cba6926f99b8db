"""Throughput, null engine: steps/s with 1, 2, 4 worker processes and 256 closed-loop sessions.

The fleet, arq and streaq on the same private Redis server, the same tiny world step, from one
trainer process and again from several (``Size.trainers``, bench.trainers) so that the trainer side
is not what is measured. Each session keeps one step in flight; steps finished inside the timed window count.
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
from bench.trainers import Drive, drive_all, split, window_values
from broker import FleetClient
from broker.redis.embedded import RedisServer

NAME = "throughput"
SESSIONS = 256


@dataclass(frozen=True)
class Size:
    workers: tuple[int, ...]
    window_s: float
    warmup_s: float
    trainers: tuple[int, ...]  # every case from one trainer process, then from this many


SIZE = {"smoke": Size(workers=(1, 2), window_s=0.5, warmup_s=0.3, trainers=(1, 2)),
        "full": Size(workers=(1, 2, 4), window_s=4.0, warmup_s=1.0, trainers=(1, 4))}

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


def ratios(rows: Sequence[Row], trainers: Sequence[int]) -> list[Row]:
    """fleet / anchor steps/s per worker count, with as many trainer processes on both sides:
    above 1 means the fleet is faster."""
    by = {(r.system, r.case): r.values["steps_s"] for r in rows}
    out: list[Row] = []
    for t in trainers:
        for case in dict.fromkeys(r.case for r in rows):
            fleet = by.get((system_name("fleet", t), case), 0.0)
            values = {anchor: fleet / by[(system_name(anchor, t), case)] for anchor in ("arq", "streaq")
                      if by.get((system_name(anchor, t), case), 0.0) > 0}
            out.append(Row(NAME, case, f"{system_name('fleet', t)} speedup vs", values, "x"))
    return out


async def trainers_row(server: RedisServer, system: str, workers: int, size: Size, trainers: int) -> Row:
    """The case with its sessions spread over ``trainers`` trainer processes (bench.trainers);
    ``cpu_us_client`` is then their CPU together."""
    queue = new_prefix(f"tp{system[:2]}")
    with Children() as children:
        if system == "fleet":
            await start_fleet_workers(children, server.url, queue, count=workers)
        else:
            for _ in range(workers):
                children.spawn([sys.executable, "-m", f"bench.{system}_anchor", "--redis-url", server.url,
                                "--queue", queue])
        drives = [Drive(system, server.url, queue, count, f"t{i}", TINY_SHAPE, size.warmup_s, size.window_s)
                  for i, count in enumerate(split(SESSIONS, trainers))]
        meter = _meter(server, children)
        values = window_values(await drive_all(drives, meter), size.window_s)
        children.check_alive()
        values.update({k: v for k, v in meter.per_step_us(int(values["steps_s"] * size.window_s)).items()
                       if k != "cpu_us_client"})
        return Row(NAME, "", "", values)


def system_name(system: str, trainers: int) -> str:
    return system if trainers == 1 else f"{system} ({trainers} trainers)"


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    rows: list[Row] = []
    with private_redis() as server:
        for trainers in sz.trainers:
            for workers in sz.workers:
                for system, measure in SYSTEMS.items():
                    row = await (measure(server, workers, sz) if trainers == 1
                                 else trainers_row(server, system, workers, sz, trainers))
                    row.system, row.case = system_name(system, trainers), f"{workers} workers x {SESSIONS} sessions"
                    row.values.update(workers=float(workers), trainers=float(trainers))
                    rows.append(row)
    return rows + ratios(rows, sz.trainers)


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
