"""Signals on a real worker process: the first SIGTERM/SIGINT drains, the second stops it now."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest

from broker import FleetClient
from broker.ops.status import cell_status
from broker.redis.embedded import RedisServer
from cli.processes import Process, spawn_worker
from tests.procs import Fleet
from tests.support import until, world_step

DRAIN_S = 300  # a drain that has nowhere to go would serve on this long: far past every bound below
STOP_BOUND_S = 60.0  # the second signal ends the process well within this, on a loaded machine too


def _worker(server: RedisServer, prefix: str, log: Path) -> Process:
    with log.open("ab") as out:
        return spawn_worker(server.url, prefix, engine="null", log_level="INFO", heartbeat_ms=200, lease_ms=1000,
                            extra=("--drain-timeout", str(DRAIN_S), "--engine-opt", "delay_ms=5"), stderr=out)


async def _state(server: RedisServer, prefix: str, worker_id: str) -> str | None:
    report = await cell_status(server.url, prefix=prefix)
    return next((w.fields.get("state") for w in report.workers if w.worker_id == worker_id), None)


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_ends_a_draining_worker_and_its_sessions_fail_over(
        redis_server: RedisServer, prefix: str, tmp_path: Path, second: signal.Signals) -> None:
    log = tmp_path / "worker.log"
    procs = Fleet(redis_server.url, prefix)
    first = _worker(redis_server, prefix, log)
    procs.procs.append(first)
    try:
        (worker_id,) = await procs.wait_active(1)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(4)]
            for s in sessions:
                assert all(r.ok for r in await asyncio.gather(*(s.submit(i, **world_step(i)) for i in range(5))))
            first.send_signal(signal.SIGTERM)  # drain: no other worker, so it keeps serving
            await until(lambda: _draining(redis_server, prefix, worker_id), "the worker did not start draining")
            queued = [[s.submit(i, **world_step(i)) for i in range(5, 10)] for s in sessions]
            first.send_signal(second)
            await asyncio.to_thread(_exits, first)
            text = log.read_text()
            assert f"second signal ({second.name}): stopping worker {worker_id} now" in text, text[-2000:]
            procs.procs.append(_worker(redis_server, prefix, tmp_path / "second.log"))
            for s, futs in zip(sessions, queued, strict=True):
                results = await asyncio.wait_for(asyncio.gather(*futs), 120)
                done = [r for r in results if r.ok]
                assert len(done) == len(results), [r.error for r in results if not r.ok]
                assert [r.output["context"] for r in done] == list(range(5, 10))  # nothing lost, nothing twice
                assert (await s.status()).committed_step_id == 9
    finally:
        procs.close()


async def _draining(server: RedisServer, prefix: str, worker_id: str) -> bool:
    return await _state(server, prefix, worker_id) == "draining"


def _exits(proc: Process) -> None:
    try:
        proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker still ran {STOP_BOUND_S:g}s after the second signal "
                             f"(its drain would have lasted {DRAIN_S}s)") from None
