"""Batch fill: how much of a GPU-like engine's ceiling the fleet reaches.

The simulated engine (bench.sim_engine) takes ``a + b*n`` ms per forward of n (a=20, b=0.5, at most
32), one forward at a time, so its ceiling is 32/(a+32b) steps per ms (889 steps/s). One fleet
worker serves it to 64 sessions that step as fast as results return; the same engine behind the
one-request-per-step HTTP anchor runs every request as a batch of one. The fleet coalesces
the script calls of one event-loop turn into one pipeline (broker.redis.scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from bench.common import (
    Children,
    Row,
    module_main,
    new_prefix,
    private_redis,
    timed_window,
    wait_fleet_workers,
    wait_for,
)
from bench.http_anchor import HttpRollout
from bench.sim_engine import SIM_MODEL, SimEngineConfig
from broker import FleetClient
from broker.redis.embedded import free_port
from cli import processes

NAME = "batch_fill"
SESSIONS = 64
CONFIG = SimEngineConfig(a_ms=20.0, b_ms=0.5, max_batch=32)


@dataclass(frozen=True)
class Size:
    warmup_s: float
    window_s: float


SIZE = {"smoke": Size(warmup_s=0.4, window_s=0.75), "full": Size(warmup_s=1.0, window_s=8.0)}


def _engine_args() -> list[str]:
    return ["--a-ms", str(CONFIG.a_ms), "--b-ms", str(CONFIG.b_ms), "--max-batch", str(CONFIG.max_batch)]


def _fleet_engine_opts(stats_path: str) -> dict[str, Any]:
    """The same engine for a fleet worker (``--engine bench.sim_engine:SimEngine``)."""
    return {"a_ms": CONFIG.a_ms, "b_ms": CONFIG.b_ms, "max_batch": CONFIG.max_batch, "stats_path": stats_path}


def _world(k: int) -> dict[str, Any]:
    return {"observation": {"prompt": "sim", "state": [0.0] * 8}}


VARIANTS: dict[str, list[str]] = {"fleet (1 worker)": []}


async def fleet_row(size: Size, variant: str) -> Row:
    prefix = new_prefix("bf")
    with tempfile.TemporaryDirectory() as tmp, private_redis() as server:
        stats_path = os.path.join(tmp, "stats.json")
        with Children() as children:
            children.spawn(processes.worker_command(server.url, prefix, engine="bench.sim_engine:SimEngine",
                                                    engine_options=_fleet_engine_opts(stats_path),
                                                    extra=VARIANTS[variant]))
            await wait_fleet_workers(server.url, prefix, 1, children)
            async with FleetClient(server.url, prefix=prefix) as fleet:
                sessions = await asyncio.gather(*(fleet.create_session(SIM_MODEL, "world_model_env")
                                                  for _ in range(SESSIONS)))

                async def step(session: Any, k: int) -> None:
                    result = await session.step(k, **_world(k))
                    if not result.ok:
                        raise RuntimeError(result.error)

                row = await timed_window(NAME, sessions, step, size.warmup_s, size.window_s)
        # The worker wrote its engine counters on its way out (SIGTERM drains, then closes the engine).
        with contextlib.suppress(OSError, ValueError), open(stats_path, encoding="utf-8") as fh:
            stats = json.load(fh)
            row.values["mean_batch"] = stats["mean_batch"]
            row.values["mean_forward_ms"] = stats["mean_forward_ms"]
    row.system = variant
    return row


async def http_row(size: Size) -> Row:
    port = free_port()
    with Children() as children:
        children.spawn([sys.executable, "-m", "bench.http_anchor", "--port", str(port), "--engine", "sim",
                        *_engine_args()])
        client = HttpRollout(f"http://127.0.0.1:{port}", pool=SESSIONS)
        try:
            await wait_for(client.ready, children, "http anchor")
            sids = await asyncio.gather(*(client.create_session(SIM_MODEL) for _ in range(SESSIONS)))

            async def step(sid: Any, k: int) -> None:
                await client.step(sid, k, _world(k))

            row = await timed_window(NAME, sids, step, size.warmup_s, size.window_s)
        finally:
            await client.aclose()
    row.system = "http (batch of 1 per request)"
    row.values["mean_batch"] = 1.0
    return row


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    ceiling = CONFIG.max_steps_per_s()
    rows = [await fleet_row(sz, variant) for variant in VARIANTS]
    rows.append(await http_row(sz))
    for row in rows:
        row.values["fill_pct"] = 100.0 * row.values["steps_s"] / ceiling
        row.note = f"ceiling {ceiling:.0f} steps/s = 32/(a+32b), a={CONFIG.a_ms} ms b={CONFIG.b_ms} ms"
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
