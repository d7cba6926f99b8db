"""What one script call per engine batch would save over today's pipeline of one call per step.

    python -m bench.script_batching --size full

A worker commits the steps of one engine batch as one pipeline of commit script calls
(``broker.redis.scripts``: calls made in the same event-loop turn leave together). The other way
is one script call that commits the whole batch, looping in Lua. This measures the difference on
a commit-shaped stand-in script (read the session's committed step, write three fields, append to
a stream, acknowledge an inbox entry: the commands ``commit.lua`` runs on the tiny-step path), at
batch sizes 8, 32 and 64, on a private Redis: the client's CPU (this process: redis-py building,
sending and reading) and Redis's CPU (``INFO cpu``), per step, best of the rounds. It is the
evidence behind docs/benchmarks.md#cpu-per-tiny-step; not in ``run_all``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from bench.common import Row, module_main, private_redis
from broker.redis.connect import open_redis

NAME = "script_batching"
BATCHES = (8, 32, 64)
ONE_STEP = """
local before = tonumber(redis.call('HGET', KEYS[1], 'committed') or '-1')
redis.call('HSET', KEYS[1], 'committed', ARGV[1], 'epoch', ARGV[2], 'len', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', '1000', '*', 'step', ARGV[1], 'result', ARGV[4])
redis.call('XACK', KEYS[3], 'workers', ARGV[5])
return {1, before}
"""
# The same commands for ARGV[1] steps: keys 3 per step, arguments 5 per step after the count.
WHOLE_BATCH = """
local replies = {}
for i = 0, tonumber(ARGV[1]) - 1 do
  local k, a = i * 3, i * 5 + 1
  local before = tonumber(redis.call('HGET', KEYS[k + 1], 'committed') or '-1')
  redis.call('HSET', KEYS[k + 1], 'committed', ARGV[a + 1], 'epoch', ARGV[a + 2], 'len', ARGV[a + 3])
  redis.call('XADD', KEYS[k + 2], 'MAXLEN', '~', '1000', '*', 'step', ARGV[a + 1], 'result', ARGV[a + 4])
  redis.call('XACK', KEYS[k + 3], 'workers', ARGV[a + 5])
  replies[i + 1] = {1, before}
end
return replies
"""
RESULT = b"\x85" * 120  # a tiny step's encoded result


@dataclass(frozen=True)
class Size:
    steps: int  # per round and way
    rounds: int  # alternated; the least disturbed round is kept


SIZE = {"smoke": Size(steps=512, rounds=1), "full": Size(steps=12_288, rounds=5)}


def stand_in_step(batch: int, i: int, step: int) -> tuple[list[str], list[object]]:
    s = f"{{c}}:{batch}:{i}"
    return [f"session:{s}", f"replies:{s}", f"inbox:{s}"], [step, 3, 17, RESULT, "0-1"]


async def _cpu(redis: Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _pipelined(redis: Redis, sha: str, batch: int, step: int) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(batch):
            keys, args = stand_in_step(batch, i, step)
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        await pipe.execute()


async def _one_call(redis: Redis, sha: str, batch: int, step: int) -> None:
    keys: list[str] = []
    args: list[object] = [batch]
    for i in range(batch):
        k, a = stand_in_step(batch, i, step)
        keys += k
        args += a
    await redis.execute_command("EVALSHA", sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]


async def measure(redis: Redis, way: str, sha: str, batch: int, steps: int) -> tuple[float, float]:
    """(client µs, Redis µs) per step, for ``steps`` steps committed ``batch`` at a time."""
    call = _pipelined if way == "pipeline" else _one_call
    redis_before, client_before = await _cpu(redis), time.process_time()
    for step in range(steps // batch):
        await call(redis, sha, batch, step)
    client, redis_cpu = time.process_time() - client_before, await _cpu(redis) - redis_before
    done = steps // batch * batch
    return 1e6 * client / done, 1e6 * redis_cpu / done


async def run(size: str) -> list[Row]:
    cfg = SIZE[size]
    rows: list[Row] = []
    with private_redis() as server:
        redis = open_redis(server.url)
        try:
            shas = {"pipeline": await redis.script_load(ONE_STEP), "one call": await redis.script_load(WHOLE_BATCH)}
            for batch in BATCHES:
                best: dict[str, tuple[float, float]] = {}
                for _ in range(cfg.rounds):
                    for way, sha in shas.items():
                        client, redis_us = await measure(redis, way, sha, batch, cfg.steps)
                        old = best.get(way)
                        best[way] = (client, redis_us) if old is None or client + redis_us < sum(old) else old
                for way, (client, redis_us) in best.items():
                    rows.append(Row(NAME, f"batch of {batch}", way, {
                        "client_us": client, "redis_us": redis_us, "total_us": client + redis_us}, unit="µs/step"))
                saved = sum(best["pipeline"]) - sum(best["one call"])
                rows.append(Row(NAME, f"batch of {batch}", "saved by one call", {"total_us": saved}, unit="µs/step"))
        finally:
            await redis.aclose()
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
