"""Throughput, null engine: steps/s with 1, 2, 4 worker processes and 256 closed-loop sessions.

The fleet, arq and streaq on the same private Redis server, the same tiny world step, from one
trainer process and again from several (``Size.trainers``, bench.trainers) so that the trainer side
is not what is measured. Each session keeps one step in flight; steps finished inside the timed window count.
Anchor settings: arq poll delay 0.01 s (worker and result wait), max_jobs 256; streaq
concurrency 256; otherwise their defaults. ``cpu_us_*`` is the CPU each process spent per step in
the window (client = this trainer process). The fleet coalesces the
script calls of one event-loop turn into one pipeline (broker.redis.scripts).

A single window of a few seconds on a shared VM swings by 20-40% (docs/benchmarks.md): at
``--size full`` each cell is measured ``Size.repeats`` times, the three systems one after the other
in a rotating order (each goes first once), so a slow minute falls on all of them. A system's row
holds the median of its windows (``steps_s``, every CPU figure) with the lowest and highest
steps/s (``steps_s_lo``, ``steps_s_hi``); a ratio row holds the ratio of the medians and, from the
windows measured side by side in one repeat, the lowest and highest ratio (``arq_lo`` ...).
"""

from __future__ import annotations

import asyncio
import statistics
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
    repeats: int  # windows per system and cell, the systems' order rotating


SIZE = {"smoke": Size(workers=(1, 2), window_s=0.5, warmup_s=0.3, trainers=(1, 2), repeats=1),
        "full": Size(workers=(1, 2, 4), window_s=4.0, warmup_s=1.0, trainers=(1, 4), repeats=3)}
ANCHORS = ("arq", "streaq")

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


def ratios(rows: Sequence[Row], trainers: Sequence[int],
           windows: dict[tuple[str, str], list[float]] | None = None) -> list[Row]:
    """fleet / anchor steps/s per worker count, with as many trainer processes on both sides:
    above 1 means the fleet is faster. The ratio of the rows' steps/s; with ``windows`` (each
    system's steps/s per repeat, by system and case) also the lowest and highest ratio of the
    windows of one repeat (``arq_lo``, ``arq_hi``, ...)."""
    by = {(r.system, r.case): r.values["steps_s"] for r in rows}
    windows = windows or {}
    out: list[Row] = []
    for t in trainers:
        for case in dict.fromkeys(r.case for r in rows):
            fleet_system = system_name("fleet", t)
            fleet = by.get((fleet_system, case), 0.0)
            values: dict[str, float] = {}
            for anchor in ANCHORS:
                anchor_system = system_name(anchor, t)
                if by.get((anchor_system, case), 0.0) <= 0:
                    continue
                values[anchor] = fleet / by[(anchor_system, case)]
                pairs = [f / a for f, a in zip(windows.get((fleet_system, case), []),
                                               windows.get((anchor_system, case), []), strict=False) if a > 0]
                if len(pairs) > 1:
                    values[f"{anchor}_lo"], values[f"{anchor}_hi"] = min(pairs), max(pairs)
            out.append(Row(NAME, case, f"{fleet_system} speedup vs", values, "x"))
    return out


def median_row(windows: Sequence[Row]) -> Row:
    """One row for a system's windows of a cell: the median of each value, with the lowest and
    highest steps/s when there are several; the first error any window met."""
    keys = dict.fromkeys(k for w in windows for k in w.values)
    values = {k: statistics.median(w.values[k] for w in windows if k in w.values) for k in keys}
    if len(windows) > 1:
        steps = [w.values["steps_s"] for w in windows]
        values.update(steps_s_lo=min(steps), steps_s_hi=max(steps), repeats=float(len(windows)))
    first = windows[0]
    note = next((w.note for w in windows if w.note), first.note)
    return Row(first.bench, first.case, first.system, values, first.unit, note)


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
    windows: dict[tuple[str, str], list[float]] = {}
    names = list(SYSTEMS)
    with private_redis() as server:
        for trainers in sz.trainers:
            for workers in sz.workers:
                case = f"{workers} workers x {SESSIONS} sessions"
                measured: dict[str, list[Row]] = {system: [] for system in names}
                for repeat in range(sz.repeats):
                    for system in names[repeat % len(names):] + names[:repeat % len(names)]:
                        row = await (SYSTEMS[system](server, workers, sz) if trainers == 1
                                     else trainers_row(server, system, workers, sz, trainers))
                        measured[system].append(row)
                for system in names:
                    row = median_row(measured[system])
                    row.system, row.case = system_name(system, trainers), case
                    row.values.update(workers=float(workers), trainers=float(trainers))
                    rows.append(row)
                    windows[(row.system, case)] = [w.values["steps_s"] for w in measured[system]]
    return rows + ratios(rows, sz.trainers, windows)


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
