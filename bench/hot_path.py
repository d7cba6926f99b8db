"""Per-call CPU of pieces of the tiny-step path, the library's way beside the fleet's, back to back.

    python -m bench.hot_path

Best of 7 timeit repeats, µs per call: redis-py's Python command packer vs the C packer of
single-node fleet clients (broker.redis.connect.packing_in_c) for the argument lists of an
enqueue and a commit script call; a job id from ``uuid.uuid4()`` vs ``new_id``; ``as_floats`` of
8 floats (the fast path) vs 8 ints (the item-by-item path every list took before); a tiny world
step's output digest the former way (every array copied to C order, its head text made per call,
every scalar through an encoder) vs ``output_digest``; and, against a private Redis, the check
redis-py's pool makes of an idle connection before each command (a read under a zero timeout: an
event-loop turn) vs the fleet's in place (broker.redis.connect.checked_in_place), and a pooled
PING through each; then redis-py's pool handing out an idle connection and taking it back (its
lock, its release event) vs the fleet's pool (broker.redis.connect.HandingOutInPlace), both with
the fleet's connections; and the frozen records a tiny world step builds (its job, input, engine
request and output, result and latency, commit call and reply entry) with the dataclass's own
``__init__`` vs schemas.records.quick_init's; and a worker's wait for its coalesced commit call,
cancellation held, through ``asyncio.shield`` (the former way) vs a ``HeldFuture``
(broker.redis.aio), each call a fresh future answered one loop callback later. Not in ``run_all``:
these are the numbers behind docs/benchmarks.md#cpu-per-tiny-step and #instructions-per-step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import timeit
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool

from bench.common import Row, module_main, private_redis
from broker.client.session import new_id
from broker.redis.aio import HeldFuture, outcome_of, resolve
from broker.redis.connect import checked_in_place, open_redis, packing_in_c
from broker.redis.inbox import InboxEntry, JobKind
from broker.redis.layouts import ReplyEntry
from broker.redis.scripts import CommitCall
from schemas.codec import _Encoder, _packb
from schemas.messages import Mode
from schemas.results import Latency, StepResult
from schemas.wire_fields import as_floats
from schemas.world_messages import Action, Observation, WorldStep
from workers.engines.base import EngineOutput, EngineRequest
from workers.rebuild import _HASHERS, DIGEST_KIND, output_digest

NAME = "hot_path"
SHA = "a" * 40
ENQUEUE = ("EVALSHA", SHA, 4, "rf:{c}:session:" + "s" * 32, "rf:{c}:inbox:w1", "rf:{c}:log:" + "s" * 32,
           "rf:{c}:announced", "w1", 17, "1", "j" * 32, "c" * 32, b"\x82" * 120, "s" * 32, 0, 0)
COMMIT = ("EVALSHA", SHA, 4, "k1" * 10, "k2" * 10, "k3" * 10, "k4" * 10, "w1", 3, 17, "1733-0", b"\x85" * 200, 0,
          "j" * 32, 3600000, "workers", b"\x83" * 120, -1, 268435456, 1048576, 600000, "0", "", "")


def best_us(call: Callable[[], object], number: int = 2000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def _pair(case: str, before: Callable[[], object], after: Callable[[], object], what: tuple[str, str]) -> Row:
    old, new = best_us(before), best_us(after)
    return Row(NAME, case, f"{what[0]} vs {what[1]}", {"before_us": old, "after_us": new, "x": old / new})


RECORDS = (InboxEntry, Observation, Action, WorldStep, EngineRequest, EngineOutput, Latency, StepResult, CommitCall,
           ReplyEntry)


def plain_twin(cls: type[Any]) -> type[Any]:
    """``cls``'s fields in a frozen dataclass of the same name with the dataclass's own ``__init__``."""
    return dataclasses.make_dataclass(cls.__name__, [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory, init=f.init,
                                           kw_only=f.kw_only))
        for f in dataclasses.fields(cls)], frozen=True)


def step_records(types: Mapping[str, type[Any]]) -> Callable[[], object]:
    """The frozen records of one tiny world step, on both sides, built from ``types`` (by name)."""
    t = types
    state, joints, output = (0.1,) * 8, (0.1,) * 7, {"video_latent": np.zeros((1, 4), np.float32)}

    def build() -> object:
        job = t["InboxEntry"]("1-0", JobKind.STEP, "j" * 32, "s" * 32, 3, True, 1, 0, Mode.WORLD_MODEL_ENV,
                              "null-world", "reply", 0, 0, b"payload")
        step = t["WorldStep"](t["Observation"]("pick the cup", {}, state, {}), t["Action"](joints, (0.5,), {}))
        t["EngineRequest"](session_key=job.session_id, model=job.model, step=step, reset=False, stateless=False)
        out = t["EngineOutput"](output=output, context_length=4)
        t["StepResult"](session_id=job.session_id, step_id=3, ok=True, committed_step_id=3, output=out.output,
                        context_length=4, latency=t["Latency"](queue_ms=0.2, engine_ms=0.1), worker_id="w1",
                        attempt=0, policy_version=0)
        t["CommitCall"](session_id=job.session_id, worker_id="w1", epoch=1, step_id=3, entry_id=job.entry_id,
                        result=b"r" * 90, context_length=4, job_id=job.job_id, reply_to="reply", reply_ttl_ms=60_000,
                        version=None, cancels=0)
        reply = t["ReplyEntry"]("step", job.job_id, 3, b"r" * 90)
        # The trainer's side: the input checked, the result decoded, then timed.
        t["WorldStep"](t["Observation"]("pick the cup", {}, state, {}), t["Action"](joints, (0.5,), {}))
        got = t["StepResult"](reply.job_id, 3, True, 3, output, None, 4, t["Latency"](0.2, 0.1, 0.0, 0.0), "w1", 0, 0)
        return t["StepResult"](got.session_id, 3, True, 3, output, None, 4, t["Latency"](0.2, 0.1, 0.5, 0.8), "w1",
                               0, 0, False)

    return build


def former_digest(output: Mapping[str, Any]) -> bytes:
    """``output_digest`` as it was at ec71c4f: the same bytes hashed (tests/test_rebuild.py
    pins them), reached the longer way."""
    h = _HASHERS[DIGEST_KIND]()
    for key in sorted(output):
        value = output[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        else:
            h.update(_packb(value, _Encoder(None, framed=False)))
    return h.digest()


async def best_async_us(call: Callable[[], Awaitable[object]], number: int) -> float:
    best = float("inf")
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(number):
            await call()
        best = min(best, time.perf_counter() - started)
    return best / number * 1e6


async def _former_outcome_of(fut: asyncio.Future[Any]) -> Any:
    """broker.redis.aio.outcome_of before HeldFuture: the future shielded from the waiter's
    cancellation (no cancellation comes here: the path every commit takes)."""
    held = False
    try:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.cancelled():
                    raise
                held = True
        return fut.result()
    finally:
        task = asyncio.current_task() if held else None
        if task is not None:
            task.uncancel()
            task.cancel()


async def _held_waits(number: int) -> Row:
    """One coalesced call's wait with the cancellation held: shielded vs a HeldFuture."""
    loop = asyncio.get_running_loop()

    async def shielded() -> object:
        fut: asyncio.Future[int] = loop.create_future()
        loop.call_soon(fut.set_result, 1)
        return await _former_outcome_of(fut)

    async def held() -> object:
        fut: HeldFuture[int] = HeldFuture(loop=loop)
        loop.call_soon(fut.set_result, 1)
        return await outcome_of(fut)

    old, new = await best_async_us(shielded, number), await best_async_us(held, number)
    return Row(NAME, "commit wait, cancellation held", "asyncio.shield vs HeldFuture",
               {"before_us": old, "after_us": new, "x": old / new})


async def _connections(url: str, number: int) -> list[Row]:
    """The pool's check of an idle connection and a pooled PING, redis-py's connection vs the
    fleet's (the same connection class but for the check)."""
    fleet = open_redis(url)
    plain = open_redis(url)
    fleet_class = fleet.connection_pool.connection_class
    plain.connection_pool.connection_class = fleet_class.__mro__[1]  # the class checked_in_place wraps
    assert checked_in_place(plain.connection_pool.connection_class) is fleet_class
    rows = []
    try:
        for client in (plain, fleet):
            await client.ping()
        conns = [await client.connection_pool.get_connection() for client in (plain, fleet)]
        for client, conn in zip((plain, fleet), conns, strict=True):
            await client.connection_pool.release(conn)
        old = await best_async_us(conns[0].can_read_destructive, number)
        new = await best_async_us(conns[1].can_read_destructive, number)
        rows.append(Row(NAME, "pool check of an idle connection", "redis-py's (an event-loop turn) vs in place",
                        {"before_us": old, "after_us": new, "x": old / new}))

        def ping(client: Redis) -> Callable[[], Awaitable[object]]:
            return lambda: resolve(client.ping())

        old, new = await best_async_us(ping(plain), number), await best_async_us(ping(fleet), number)
        rows.append(Row(NAME, "pooled PING, round trip", "redis-py's check vs in place",
                        {"before_us": old, "after_us": new, "x": old / new}))
        rows.append(await _pools(fleet, number))
    finally:
        await plain.aclose()
        await fleet.aclose()
    return rows


async def _pools(fleet: Redis, number: int) -> Row:
    """An idle connection handed out and taken back: redis-py's pool vs the fleet's, the same
    connection class (the fleet's) in both."""
    ours = fleet.connection_pool
    theirs = ConnectionPool(**{**ours.connection_kwargs, "connection_class": ours.connection_class})
    try:
        def cycle(pool: ConnectionPool) -> Callable[[], Awaitable[object]]:
            async def get_and_release() -> None:
                await pool.release(await pool.get_connection())
            return get_and_release

        for pool in (theirs, ours):
            await cycle(pool)()  # connected once, idle from then on
        old, new = await best_async_us(cycle(theirs), number), await best_async_us(cycle(ours), number)
        return Row(NAME, "pool hand-out and take-back of an idle connection", "redis-py's pool vs in place",
                   {"before_us": old, "after_us": new, "x": old / new})
    finally:
        await theirs.disconnect()


async def run(size: str) -> list[Row]:
    plain, fast = Connection(), packing_in_c(Connection)()
    packers = ("redis-py packer", "C packer")
    floats, ints = [0.1] * 8, [1] * 8
    world = {"video_latent": np.full((1, 4), 3.0, dtype=np.float32), "context": 7}
    assert former_digest(world) == output_digest(world)
    with private_redis() as server:
        connections = await _connections(server.url, 2000 if size == "full" else 200)
    held_waits = await _held_waits(20000 if size == "full" else 2000)
    plain_records = {cls.__name__: plain_twin(cls) for cls in RECORDS}
    return [
        *connections,
        held_waits,
        _pair("frozen records of a tiny world step", step_records(plain_records),
              step_records({cls.__name__: cls for cls in RECORDS}), ("dataclass __init__", "quick_init")),
        _pair("output digest, tiny world step", lambda: former_digest(world), lambda: output_digest(world),
              ("the former way", "output_digest")),
        _pair("pack enqueue EVALSHA (16 args)", lambda: plain.pack_command(*ENQUEUE),
              lambda: fast.pack_command(*ENQUEUE), packers),
        _pair("pack commit EVALSHA (24 args)", lambda: plain.pack_command(*COMMIT),
              lambda: fast.pack_command(*COMMIT), packers),
        _pair("job id", lambda: uuid.uuid4().hex, new_id, ("uuid4().hex", "new_id")),
        _pair("as_floats, 8 values", lambda: as_floats(ints, "x"), lambda: as_floats(floats, "x"),
              ("item by item (ints)", "fast path (floats)")),
    ]


def main(argv: list[str] | None = None) -> int:
    return module_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
