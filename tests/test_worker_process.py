"""Real worker processes (the CLI) against a real Redis: placement, ordering, SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from broker import FleetClient
from broker.ops.status import cell_status
from broker.redis.embedded import RedisServer
from cli.processes import spawn_worker, stop
from schemas.errors import InvalidRequestError
from tests.support import world_step

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
# A drain whose sessions find no other worker with room serves them on for its whole timeout
# (workers/drain.py); here every worker stops at once, so that is kept short.
DRAIN = ["--drain-timeout", "3"]


async def wait_workers(url: str, prefix: str, count: int, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = await cell_status(url, prefix=prefix)
        active = [w.worker_id for w in report.workers if w.fields.get("state") == "active"]
        if len(active) >= count:
            return active
        await asyncio.sleep(0.1)
    raise TimeoutError("workers did not register")


async def test_two_worker_processes_serve_many_sessions_in_order(redis_server: RedisServer, prefix: str) -> None:
    procs = [spawn_worker(redis_server.url, prefix, engine="null", extra=DRAIN) for _ in range(2)]
    try:
        ids = await wait_workers(redis_server.url, prefix, 2)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(24)]
            assert {s.owner for s in sessions} == set(ids)
            batches = await asyncio.gather(
                *[asyncio.gather(*[s.submit(i, **world_step(i)) for i in range(20)]) for s in sessions])
            for s, results in zip(sessions, batches, strict=True):
                assert [r.output["context"] for r in results] == list(range(20))
                assert {r.worker_id for r in results} == {s.owner}
                assert (await s.status()).committed_step_id == 19
    finally:
        stop(procs, grace_s=30)
    assert [p.returncode for p in procs] == [0, 0]


async def test_sigterm_finishes_in_flight_steps_then_exits(redis_server: RedisServer, prefix: str) -> None:
    proc = spawn_worker(redis_server.url, prefix, engine="null", engine_options={"delay_ms": 400}, extra=DRAIN)
    try:
        await wait_workers(redis_server.url, prefix, 1)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(6)]
            futs = [s.submit(0, **world_step(0)) for s in sessions]
            await asyncio.sleep(0.2)  # the worker has read them and the engine is busy
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*futs), 30)
            assert all(r.ok for r in results), [r.error for r in results]
            assert await asyncio.to_thread(proc.wait, 30) == 0
            report = await cell_status(redis_server.url, prefix=prefix)
            assert [w.fields.get("state") for w in report.workers] == ["stopped"]
            with pytest.raises(InvalidRequestError, match="no worker serves"):
                await fleet.create_session(model="null-world", mode="world_model_env")
    finally:
        stop([proc], grace_s=30)
