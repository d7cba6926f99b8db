"""Latent transport: encode + decode of a float32 latent through schemas.codec (its array frame,
and the plain msgpack it still reads) vs base64-in-JSON (the vLLM-Omni rollout API's
``video_latent`` encoding) vs a memcpy floor, and the bytes of each; then the same bytes through
Redis (SET + GET, redis-py asyncio).

The memcpy floor is what any encoding of one array into one new ``bytes`` and back must at least
do: encode copies the array into a fresh ``bytes`` of its size (``tobytes``, the allocation the
codec's join makes), decode wraps the bytes without copying (``np.frombuffer``, what the codec's
decode does). Every timing here is warmed and the best of many: a large copy's cost swings with
the allocator's state and the machine's load, and the least disturbed run is the floor.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.asyncio import Redis

from bench.common import Row, module_main, private_redis
from broker.redis.connect import open_redis
from schemas.codec import decode, encode, encode_plain
from schemas.latent_json import decode_latent_json, encode_latent_json

NAME = "transport"
SHAPES = ((1, 16, 2, 44, 80), (1, 16, 8, 44, 80))
FLOOR = "memcpy floor (tobytes + frombuffer)"


@dataclass(frozen=True)
class Size:
    timing_s: float  # wall time of one timing (calls per timing follow from it)
    repeat: int  # timings; the minimum is kept (the least disturbed run, as timeit advises)
    redis_pairs: int


# Short timings, many of them: on a shared machine a long timing is rarely left alone for its
# whole length, and the floor is what the least disturbed timing saw.
SIZE = {"smoke": Size(timing_s=0.002, repeat=5, redis_pairs=10),
        "full": Size(timing_s=0.002, repeat=301, redis_pairs=100)}


# --------------------------------------------------------------------------- the encodings


def b64_encode(latent: np.ndarray) -> bytes:
    return json.dumps(encode_latent_json(latent)).encode()


def b64_decode(data: bytes) -> np.ndarray:
    return decode_latent_json(json.loads(data))


Codec = tuple[Callable[[np.ndarray], bytes], Callable[[bytes], Any]]
ENCODINGS: dict[str, Codec] = {
    "codec": (lambda a: encode({"video_latent": a}), decode),
    "codec plain msgpack (version 1)": (lambda a: encode_plain({"video_latent": a}), decode),
    "base64-json": (b64_encode, b64_decode),
}


# --------------------------------------------------------------------------- timing


def best_ms(fn: Callable[[], Any], size: Size) -> float:
    for _ in range(20):  # warm: the allocator settles on reusing the freed block
        fn()
    once = timeit.timeit(fn, number=1)
    number = max(2, min(5000, int(size.timing_s / max(once, 1e-7))))
    return min(timeit.repeat(fn, number=number, repeat=size.repeat)) / number * 1000.0


def floor_row(latent: np.ndarray, size: Size) -> Row:
    data = latent.tobytes()
    enc_ms = best_ms(latent.tobytes, size)
    dec_ms = best_ms(functools.partial(np.frombuffer, data, np.float32), size)
    return Row(NAME, f"{latent.shape} f32", FLOOR, {"encode_ms": enc_ms, "decode_ms": dec_ms,
                                                    "total_ms": enc_ms + dec_ms, "bytes": float(latent.nbytes)}, "")


def cpu_rows(shape: tuple[int, ...], size: Size) -> list[Row]:
    latent = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    case = f"{shape} f32"
    rows = [floor_row(latent, size)]
    floor = rows[0].values["total_ms"]
    for name, (enc, dec) in ENCODINGS.items():
        data = enc(latent)
        if not np.array_equal(_latent_of(dec(data)), latent):
            raise AssertionError(f"{name} does not round-trip")  # correctness, not speed
        enc_ms = best_ms(functools.partial(enc, latent), size)
        dec_ms = best_ms(functools.partial(dec, data), size)
        rows.append(Row(NAME, case, name, {"encode_ms": enc_ms, "decode_ms": dec_ms, "total_ms": enc_ms + dec_ms,
                                           "bytes": float(len(data)), "x_memcpy": (enc_ms + dec_ms) / floor}))
    return rows


def fixed_cost_row(size: Size) -> Row:
    """The codec's cost apart from the copy: encode + decode of a one-element array in the same
    message. It is what keeps a small latent's ratio to the memcpy floor above 1."""
    enc, dec = ENCODINGS["codec"]
    one = np.ones(1, dtype=np.float32)
    data = enc(one)
    enc_us = best_ms(functools.partial(enc, one), size) * 1000.0
    dec_us = best_ms(functools.partial(dec, data), size) * 1000.0
    return Row(NAME, "(1,) f32, fixed cost", "codec", {"encode_us": enc_us, "decode_us": dec_us,
                                                      "total_us": enc_us + dec_us, "bytes": float(len(data))}, "")


def _latent_of(decoded: Any) -> np.ndarray:
    return decoded["video_latent"] if isinstance(decoded, dict) else np.asarray(decoded)


async def cpu_rows_in_child(size: str) -> list[Row]:
    """The CPU timings in a fresh interpreter: a large buffer's cost depends on the allocator's
    history (glibc raises its mmap threshold as blocks are freed), so earlier benchmarks in this
    process must not decide it. The child inherits the environment (MALLOC_* when tuned)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.transport", "--size", size,
                                                "--cpu-json", stdout=asyncio.subprocess.PIPE)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"transport CPU child exited {proc.returncode}")
    return [Row(**row) for row in json.loads(out)]


async def lua_argv_row(redis: Redis, shape: tuple[int, ...], data: bytes, size: Size) -> Row:
    """Redis's own time (INFO commandstats) to take the same bytes as a plain SET argument and as
    an argument of a Lua script that ignores it: the commit script receives the result this way."""
    noop = redis.register_script("return 1")
    await noop(keys=["bench:transport"], args=[data])
    await redis.config_resetstat()
    for _ in range(size.redis_pairs):
        await redis.set("bench:transport", data)
        await noop(keys=["bench:transport"], args=[data])
    stats: Any = await redis.info("commandstats")
    values = {"set_us": float(stats["cmdstat_set"]["usec_per_call"]),
              "evalsha_argv_us": float(stats["cmdstat_evalsha"]["usec_per_call"]), "bytes": float(len(data))}
    return Row(NAME, f"{shape} f32 via redis", "redis server time: SET vs Lua ARGV", values, "",
               "single-threaded Redis time per call")


async def redis_rows(url: str, shape: tuple[int, ...], size: Size) -> list[Row]:
    latent = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    payloads = {"raw bytes": latent.tobytes(), **{name: enc(latent) for name, (enc, _) in ENCODINGS.items()}}
    redis = open_redis(url)
    rows: list[Row] = []
    try:
        for name, data in payloads.items():
            await redis.set("bench:transport", data)  # warm the connection and the allocation
            best = math.inf
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(size.redis_pairs):
                    await redis.set("bench:transport", data)
                    await redis.get("bench:transport")
                best = min(best, (time.perf_counter() - started) / size.redis_pairs * 1000.0)
            rows.append(Row(NAME, f"{shape} f32 via redis", name, {"set_get_ms": best, "bytes": float(len(data))}))
        rows.append(await lua_argv_row(redis, shape, payloads["codec"], size))
    finally:
        await redis.delete("bench:transport")
        await redis.aclose()
    return rows


def ratios(rows: list[Row]) -> list[Row]:
    by = {(r.case, r.system): r.values for r in rows}
    out: list[Row] = []
    for shape in SHAPES:
        case = f"{shape} f32"
        codec, b64, memcpy = by[(case, "codec")], by[(case, "base64-json")], by[(case, FLOOR)]
        out.append(Row(NAME, case, "codec vs base64-json", {
            "speedup": b64["total_ms"] / codec["total_ms"], "smaller_pct": 100.0 * (1 - codec["bytes"] / b64["bytes"]),
            "codec_x_memcpy": codec["total_ms"] / memcpy["total_ms"]}, "", "speedup: x faster; x_memcpy: x slower"))
    return out


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    rows = await cpu_rows_in_child(size)
    with private_redis() as server:
        for shape in SHAPES:
            rows += await redis_rows(server.url, shape, sz)
    return rows + ratios(rows)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--cpu-json" in args:  # the child of cpu_rows_in_child
        args.remove("--cpu-json")
        size = SIZE[args[args.index("--size") + 1]] if "--size" in args else SIZE["smoke"]
        rows = [row for shape in SHAPES for row in cpu_rows(shape, size)] + [fixed_cost_row(size)]
        print(json.dumps([row.to_json() for row in rows]))
        return 0
    return module_main(NAME, run, args)


if __name__ == "__main__":
    raise SystemExit(main())
