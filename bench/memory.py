"""Memory: Redis ``used_memory`` delta per live session and per committed step record.

Both modes on the null engine: world (the default (1, 16, 2, 44, 80) float32 latent, a small
observation without images) and tokens (32 prompt ids echoed back). Each session keeps its last
``result_window`` results (default 4) for idempotent retries, and with the default retention
``full`` a step record (input payload + output digest) per committed step for context rebuild.
So the cost of a step is measured twice: ``per_step_B`` while the window fills (used_memory delta:
result + record + stream bookkeeping), and ``per_step_window_full_B`` once it is full (the oldest
result is dropped, what a step keeps for good is its record; MEMORY USAGE of the session's log hash,
exact where a used_memory delta of a few hundred bytes would drown in allocator noise).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from bench.common import (
    LATENT_SHAPE,
    Children,
    Row,
    module_main,
    new_prefix,
    private_redis,
    start_fleet_workers,
    world_inputs,
)
from broker import FleetClient
from broker.redis.connect import open_redis

NAME = "memory"
RESULT_WINDOW = 4  # FleetClient.create_session's default
MODES = {"world": ("null-world", "world_model_env"), "tokens": ("null-lm", "tokens")}


@dataclass(frozen=True)
class Size:
    sessions: int  # created (per-session cost)
    stepping: dict[str, int]  # of which this many run steps, per mode (world results are 450 KB each)


SIZE = {"smoke": Size(sessions=32, stepping={"world": 8, "tokens": 32}),
        "full": Size(sessions=200, stepping={"world": 32, "tokens": 200})}


def _inputs(mode: str, k: int) -> dict[str, Any]:
    if mode == "world":
        return world_inputs(k)
    return {"token_ids": [(7 * k + i) % 256 for i in range(32)], "sampling": {"max_tokens": 16}}


async def used_memory(redis: Redis) -> int:
    """used_memory less the clients' buffers: a 450 KB reply or command sits in a client's buffer
    for a while after it is served, and that is connection state, not what the fleet stores."""
    await asyncio.sleep(0.3)  # the client deletes read reply entries in the background
    info: Any = await redis.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


async def key_bytes(redis: Redis, keys: list[str]) -> float:
    sizes = [int(await redis.memory_usage(key, samples=0) or 0) for key in keys]
    return sum(sizes) / max(1, len(sizes))


async def measure_mode(url: str, fleet: FleetClient, mode: str, size: Size) -> Row:
    redis = open_redis(url)
    try:
        model, wire_mode = MODES[mode]
        m0 = await used_memory(redis)
        sessions = await asyncio.gather(*(fleet.create_session(model, wire_mode, result_window=RESULT_WINDOW)
                                          for _ in range(size.sessions)))
        m1 = await used_memory(redis)

        async def steps(session: Any, first: int) -> None:
            for k in range(first, first + RESULT_WINDOW):
                result = await session.step(k, **_inputs(mode, k))
                if not result.ok:
                    raise RuntimeError(result.error)

        stepping = sessions[: size.stepping[mode]]
        logs = [fleet.keys.log(s.session_id) for s in stepping]
        await asyncio.gather(*(steps(s, 0) for s in stepping))
        m2 = await used_memory(redis)
        log_full = await key_bytes(redis, logs)
        await asyncio.gather(*(steps(s, RESULT_WINDOW) for s in stepping))
        log_later = await key_bytes(redis, logs)
        session_hash = await key_bytes(redis, [fleet.keys.session(s.session_id) for s in sessions])
    finally:
        await redis.aclose()
    n, w = size.stepping[mode], RESULT_WINDOW
    values = {"per_session_B": (m1 - m0) / size.sessions, "session_hash_B": session_hash,
              "per_step_B": (m2 - m1) / (n * w), "log_hash_B": log_full,
              "per_step_window_full_B": (log_later - log_full) / w,
              "window": float(w), "sessions": float(size.sessions)}
    return Row(NAME, mode, "fleet (redis used_memory)", values, "",
               f"result_window={w}, retention=full (one step record per committed step)")


async def run(size: str) -> list[Row]:
    rows: list[Row] = []
    for mode in MODES:  # a fresh server per mode: one mode's freed buffers must not blur the other
        prefix = new_prefix("mem")
        with private_redis() as server, Children() as children:
            await start_fleet_workers(children, server.url, prefix, latent_shape=LATENT_SHAPE)
            async with FleetClient(server.url, prefix=prefix) as fleet:
                rows.append(await measure_mode(server.url, fleet, mode, SIZE[size]))
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
