"""Rebalancing: sessions stepping closed-loop on one busy worker; a second worker joins. Measures the
time from its registration to its first step served and to a balanced split (owned counts within
the threshold), steps/s before and after, and errors seen by the trainer (must be 0).

Real processes: 2 null-engine workers (a simulated 20 ms engine batch, so one worker is the
bottleneck), default rebalancing (every 5 s with jitter, threshold 0.25), a trainer here.
"""

from __future__ import annotations

import asyncio
import time

from bench.common import Children, Row, module_main, new_prefix, private_redis, wait_fleet_workers, world_inputs
from broker import FleetClient, Session
from cli.processes import worker_command

CAPACITY, DELAY_MS = 16, 20


async def _drive(session: Session, trace: list[tuple[float, str]], errors: list[str], stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        r = await session.step(i, **world_inputs(i))
        if not r.ok:
            errors.append(f"{session.session_id} step {i}: {r.error}")
            return
        trace.append((time.time(), r.worker_id))
        i += 1


async def _balanced(fleet: FleetClient, workers: list[str]) -> bool:
    owned = [int(await fleet.redis.hget(fleet.keys.owned, w) or 0) for w in workers]
    return max(owned) - min(owned) <= 0.25 * CAPACITY


async def _joined_id(fleet: FleetClient, known: str) -> str:
    members = [m.decode() for m in await fleet.redis.zrange(fleet.keys.workers, 0, -1)]
    return next(m for m in members if m != known)


def _rate(trace: list[tuple[float, str]], t0: float, t1: float) -> float:
    return sum(1 for t, _ in trace if t0 <= t < t1) / max(t1 - t0, 1e-9)


async def run(size: str) -> list[Row]:
    sessions_n = 8 if size == "smoke" else CAPACITY
    prefix = new_prefix("rb")
    trace: list[tuple[float, str]] = []
    errors: list[str] = []
    stop = asyncio.Event()
    with private_redis() as server, Children() as children:
        opts = {"delay_ms": DELAY_MS}
        children.spawn(worker_command(server.url, prefix, engine_options=opts, extra=["--capacity", str(CAPACITY)]))
        await wait_fleet_workers(server.url, prefix, 1, children)
        async with FleetClient(server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env")
                        for _ in range(sessions_n)]
            busy = sessions[0].owner
            drivers = [asyncio.create_task(_drive(s, trace, errors, stop)) for s in sessions]
            await asyncio.sleep(3.0)
            children.spawn(worker_command(server.url, prefix, engine_options=opts, extra=["--capacity", str(CAPACITY)]))
            await wait_fleet_workers(server.url, prefix, 2, children)
            joined_at, fresh = time.time(), await _joined_id(fleet, busy)
            deadline = joined_at + 60.0
            while not await _balanced(fleet, [busy, fresh]) and time.time() < deadline:
                await asyncio.sleep(0.05)
            balanced_at = time.time()
            await asyncio.sleep(3.0)
            stop.set()
            await asyncio.gather(*drivers)
    first = min((t for t, w in trace if w == fresh), default=float("nan"))
    case = f"{sessions_n} sessions on 1 worker (capacity {CAPACITY}, {DELAY_MS} ms batches), a 2nd joins"
    return [
        Row("rebalance", case, "fleet", {"join_to_first_step_ms": (first - joined_at) * 1000,
                                         "join_to_balanced_ms": (balanced_at - joined_at) * 1000,
                                         "errors": float(len(errors))}, "", "rebalance every 5 s ± 25 %"),
        Row("rebalance", case, "steps/s", {"before": _rate(trace, joined_at - 3.0, joined_at),
                                           "after": _rate(trace, balanced_at, balanced_at + 3.0)}),
    ]


if __name__ == "__main__":
    raise SystemExit(module_main("rebalance", run))
