"""The supervisor's arq queue carries msgpack only: a pickled job is refused without being run."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shlex
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.worker import Worker as ArqWorker
from redis.asyncio import Redis

from broker.ops.arq_queue import MAX_ARQ_JOB_BYTES, arq_pool, pack_arq, unpack_arq
from broker.ops.supervisor import SupervisorSettings, build_worker, request_replay
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer, free_port
from tests.support import stop_supervisor


class _ShellCommand:
    """What an attacker pickles: unpickling it runs a shell command (here: creates a file)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


@pytest.fixture
def settings(redis_server: RedisServer, prefix: str) -> SupervisorSettings:
    return SupervisorSettings(CellConfig(redis_url=redis_server.url, prefix=prefix))


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def _run_until(supervisor: ArqWorker, done: object, timeout: float = 10.0) -> None:
    """Run the supervisor until the coroutine function ``done`` answers true (or fail)."""
    task = asyncio.create_task(supervisor.async_run())
    try:
        deadline = time.monotonic() + timeout
        while not await done():  # type: ignore[operator]
            assert time.monotonic() < deadline, "the supervisor did not handle the job in time"
            assert not task.done(), f"the supervisor stopped: {task.exception()}"
            await asyncio.sleep(0.05)
    finally:
        await stop_supervisor(supervisor, task)


async def test_a_pickled_job_in_the_queue_is_refused_without_being_run(
    settings: SupervisorSettings, redis: Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    job_id = "forged-job"
    now_ms = int(time.time() * 1000)
    forged = {"t": 1, "f": "replay_dead", "a": [_ShellCommand(f"touch {shlex.quote(str(marker))}")],
              "k": {}, "et": now_ms}
    await redis.set(job_key_prefix + job_id, pickle.dumps(forged))
    await redis.zadd(settings.cell_config.keys.arq_queue, {job_id: now_ms})

    async def refused() -> bool:
        return bool(await redis.exists(result_key_prefix + job_id))

    with caplog.at_level(logging.WARNING, logger="arq"):
        await _run_until(build_worker(settings, handle_signals=False), refused)
    assert not marker.exists(), "the supervisor unpickled the job and ran its command"
    assert await redis.zscore(settings.cell_config.keys.arq_queue, job_id) is None  # dropped
    assert f"deserializing job {job_id} failed" in caplog.text
    result = unpack_arq(await redis.get(result_key_prefix + job_id))  # the refusal, as msgpack
    assert result["s"] is False and "DeserializationError" in result["r"]


async def test_a_replay_request_travels_as_msgpack_and_still_runs(
    settings: SupervisorSettings, redis: Redis
) -> None:
    job_id = await request_replay(settings, {"session": "nobody"}, dry_run=True)
    stored = await redis.get(job_key_prefix + job_id)
    assert stored is not None
    job = msgpack.unpackb(stored, raw=False)  # not pickle
    assert (job["f"], job["a"]) == ("replay_dead", [{"session": "nobody"}, True])

    async def ran() -> bool:
        return bool(await redis.exists(result_key_prefix + job_id))

    await _run_until(build_worker(settings, handle_signals=False), ran)
    result = unpack_arq(await redis.get(result_key_prefix + job_id))
    assert result["s"] is True and result["r"] == []


def test_the_job_codec_refuses_what_is_not_msgpack_or_too_large() -> None:
    assert unpack_arq(pack_arq({"f": "replay_dead", "a": (1, "x")})) == {"f": "replay_dead", "a": [1, "x"]}
    assert pack_arq(RuntimeError("boom")) == pack_arq("RuntimeError: boom")  # a failed job's result
    with pytest.raises(TypeError):
        pack_arq(object())
    with pytest.raises(ValueError):
        unpack_arq(pickle.dumps({"f": "replay_dead"}))
    with pytest.raises(ValueError, match="refused"):
        unpack_arq(b"\x00" * (MAX_ARQ_JOB_BYTES + 1))


async def test_the_arq_pool_keeps_every_connection_setting_of_the_url(tmp_path: Path) -> None:
    url = f"rediss://fleet:s3cret@redis.internal:6380/2?ssl_ca_certs={tmp_path}/ca.pem&ssl_cert_reqs=required"
    pool = arq_pool(CellConfig(redis_url=url, prefix="rfx"))
    try:
        kwargs = pool.connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("redis.internal", 6380, 2)
        assert (kwargs["username"], kwargs["password"]) == ("fleet", "s3cret")
        assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"]) == (f"{tmp_path}/ca.pem", "required")
        assert pool.default_queue_name == "rfx:{0}:arq"
        assert (pool.job_serializer, pool.job_deserializer) == (pack_arq, unpack_arq)
    finally:
        await pool.aclose()


async def test_a_supervisor_started_before_redis_answers_waits_for_it() -> None:
    port = free_port()
    settings = SupervisorSettings(CellConfig(redis_url=f"redis://127.0.0.1:{port}/0", prefix="early"))
    supervisor = build_worker(settings, handle_signals=False)
    task = asyncio.create_task(supervisor.async_run())
    server = None
    try:
        await asyncio.sleep(1.0)  # the supervisor is retrying the refused connection meanwhile
        assert not task.done(), f"the supervisor gave up: {task.exception()}"
        server = await asyncio.to_thread(RedisServer(port=port).start)
        redis = Redis.from_url(server.url)
        try:
            for _ in range(200):  # the health-check key says arq's loop is running
                if await redis.exists(f"{settings.cell_config.keys.arq_queue}:health-check"):
                    break
                await asyncio.sleep(0.05)
            assert await redis.exists(f"{settings.cell_config.keys.arq_queue}:health-check")
        finally:
            await redis.aclose()
    finally:
        await stop_supervisor(supervisor, task)
        if server is not None:
            server.cleanup()


async def test_two_cells_supervisors_on_one_redis_both_run_every_tick(redis_server: RedisServer, prefix: str,
                                                                       redis: Redis) -> None:
    """arq's job keys are shared by every cell on a Redis: a cron tick of one cell must not be taken
    for the other's (both would be "reap:<tick>" and the second enqueue is skipped)."""
    cells = [CellConfig(redis_url=redis_server.url, prefix=prefix, cell=c) for c in ("a", "b")]
    supervisors = [build_worker(SupervisorSettings(c), handle_signals=False) for c in cells]

    async def ticks(config: CellConfig) -> set[str]:
        pattern = f"{in_progress_key_prefix}{config.keys.arq_queue}:reap:*"  # a tick's claim
        return {key.decode().rsplit(":", 1)[1] async for key in redis.scan_iter(match=pattern)}

    async def both_reaped_one_tick() -> bool:
        return bool(await ticks(cells[0]) & await ticks(cells[1]))

    other = asyncio.create_task(supervisors[1].async_run())
    try:
        await _run_until(supervisors[0], both_reaped_one_tick, timeout=15.0)
    finally:
        await stop_supervisor(supervisors[1], other)


async def test_a_stop_during_a_pass_closes_the_supervisor_cleanly(settings: SupervisorSettings,
                                                                  redis: Redis) -> None:
    """arq's own close raised the CancelledError of a job it had just cancelled (a SIGTERM during a
    reap pass: a traceback on exit, on_shutdown skipped)."""
    supervisor = build_worker(settings, handle_signals=False)
    task = asyncio.create_task(supervisor.async_run())
    health = f"{settings.cell_config.keys.arq_queue}:health-check"
    try:
        for _ in range(200):
            if await redis.exists(health):
                break
            await asyncio.sleep(0.05)
        assert await redis.exists(health)
        passing = asyncio.create_task(asyncio.sleep(30))  # a job in the middle of its pass
        supervisor.tasks["a-pass"] = passing
        await asyncio.wait_for(supervisor.close(), 10)  # raised CancelledError with arq's close
        assert passing.cancelled() and supervisor.tasks == {}
        assert not await redis.exists(health)  # the rest of close ran: the health key is gone
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
