"""Large results and step payloads out of Lua arguments (broker/redis/blobs.py, inputs.py): what a
commit and an enqueue cost Redis, and the latent steps/s of one cell.

``commit`` rows: Redis's own time per commit (INFO commandstats: the EVALSHA of commit.lua plus,
when staged, the SET before it) for results from 4 KiB to 1.8 MB, with the result as a Lua
argument and staged (the threshold of ``Scripts.stage_bytes`` moved to force either path).
``enqueue`` rows: the same for an enqueue of a step payload of each size (an observation with images).
``cell`` rows: steps/s of one cell with 1, 2 and 4 null-engine worker processes, 64 closed-loop
world sessions whose results are (1, 16, 2, 44, 80) float32 latents (450 KB), and the CPU each
process spent per step; ``redis_us_per_step``: Redis's own time in commands per step (INFO
commandstats), the part of the cell's one thread each step takes, and the bound it sets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from bench.common import (
    LATENT_SHAPE,
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
from broker.redis.connect import open_redis
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from broker.redis.scripts import CommitCall, Scripts

NAME = "result_blobs"
RESULT_SIZES = (4096, 16384, 32768, 65536, 262144, 450560, 1802240)
PATHS = {"lua-arg": 1 << 62, "staged": 0}  # Scripts.stage_bytes forcing each path
SESSIONS = 64


@dataclass(frozen=True)
class Size:
    commits: int  # commits per (result size, path)
    workers: tuple[int, ...]
    window_s: float
    warmup_s: float


SIZE = {"smoke": Size(commits=20, workers=(1,), window_s=0.5, warmup_s=0.3),
        "full": Size(commits=300, workers=(1, 2, 4), window_s=4.0, warmup_s=1.0)}


async def commit_row(scripts: Scripts, nbytes: int, path: str, commits: int) -> Row:
    """Redis time per commit of ``commits`` steps of one session, results of ``nbytes``."""
    scripts.stage_bytes = PATHS[path]
    sid = f"s{nbytes}{path}"
    await scripts.create(sid, "tokens", "m", lease_ms=60_000, retention="none", result_window=1)
    result = bytes(nbytes)
    await scripts.redis.config_resetstat()
    for step in range(commits):
        await scripts.commit(CommitCall(session_id=sid, worker_id="w", epoch=1, step_id=step, entry_id="0-1",
                                        result=result, context_length=step, job_id=f"j{step}", reply_to="c",
                                        reply_ttl_ms=60_000))
        await scripts.redis.delete(scripts.keys.reply("c"), scripts.keys.reply_blob("c", f"j{step}"))
    stats: Any = await scripts.redis.info("commandstats")
    total = sum(float(stats[f"cmdstat_{name}"]["usec"]) for name in ("evalsha", "set") if f"cmdstat_{name}" in stats)
    return Row(NAME, f"commit of a {nbytes} B result", path, {"redis_us_per_commit": total / commits,
                                                                "bytes": float(nbytes)})


async def enqueue_row(scripts: Scripts, nbytes: int, path: str, enqueues: int) -> Row:
    """Redis time per enqueue of a step whose payload is ``nbytes`` (an observation with images),
    as a Lua argument and staged (broker/redis/inputs.py)."""
    scripts.stage_bytes = PATHS[path]
    sid = f"e{nbytes}{path}"
    await scripts.create(sid, "tokens", "m", lease_ms=60_000, retention="none", result_window=1)
    payload, k = bytes(nbytes), scripts.keys
    await scripts.redis.config_resetstat()
    for step in range(enqueues):
        await scripts.enqueue(sid, "w", step_id=step, contextual=True, job_id=f"j{step}", reply_to="c",
                              payload=payload)
        await scripts.redis.delete(k.inbox("w"), k.input_blob(sid, f"j{step}"))  # not kept: memory
    stats: Any = await scripts.redis.info("commandstats")
    total = sum(float(stats[f"cmdstat_{name}"]["usec"]) for name in ("evalsha", "set") if f"cmdstat_{name}" in stats)
    return Row(NAME, f"enqueue of a {nbytes} B payload", path, {"redis_us_per_enqueue": total / enqueues,
                                                                  "bytes": float(nbytes)})


async def commit_rows(server: RedisServer, size: Size) -> list[Row]:
    redis = open_redis(server.url)
    scripts = Scripts(redis, CellKeys(prefix=new_prefix("rb")), coalesce=False)
    try:
        await scripts.register("w", capacity=1 << 20, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=600_000,
                               fields={"state": "active"})
        rows = [await commit_row(scripts, nbytes, path, size.commits) for nbytes in RESULT_SIZES for path in PATHS]
        return rows + [await enqueue_row(scripts, nbytes, path, size.commits)
                       for nbytes in RESULT_SIZES for path in PATHS]
    finally:
        await redis.aclose()


async def cell_row(server: RedisServer, workers: int, size: Size) -> Row:
    prefix = new_prefix("rbc")
    with Children() as children:
        await start_fleet_workers(children, server.url, prefix, count=workers, latent_shape=LATENT_SHAPE)
        async with FleetClient(server.url, prefix=prefix) as fleet:
            sessions = await asyncio.gather(*(fleet.create_session("null-world", "world_model_env")
                                              for _ in range(SESSIONS)))

            steps = 0

            async def step(session: Any, k: int) -> None:
                nonlocal steps
                result = await session.step(k, **world_inputs(k))
                if not result.ok:
                    raise RuntimeError(result.error)
                steps += 1

            redis_pid = [server.process.pid] if server.process is not None else []
            meter = CpuMeter({"workers": [p.pid for p in children.procs], "redis": redis_pid})
            await fleet.redis.config_resetstat()
            row = await timed_window(NAME, sessions, step, size.warmup_s, size.window_s, meter)
            row.values.update(await _redis_time(fleet, steps))
    row.case, row.system = f"{workers} workers x {SESSIONS} latent sessions", "fleet"
    return row


async def _redis_time(fleet: FleetClient, steps: int) -> dict[str, float]:
    """Redis's own time in commands per step (INFO commandstats, every command of the run): the
    time of the cell's one thread a step takes, so 1e6 / it bounds the cell's steps/s."""
    stats: Any = await fleet.redis.info("commandstats")
    per_step = sum(float(v["usec"]) for v in stats.values()) / max(1, steps)
    return {"redis_us_per_step": per_step, "cell_bound_steps_s": 1e6 / per_step if per_step else 0.0}


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    with private_redis() as server:
        rows = await commit_rows(server, sz)
        for workers in sz.workers:
            rows.append(await cell_row(server, workers, sz))
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
