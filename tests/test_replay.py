"""Retries, dead letters and replay (API and CLI), and the arq supervisor."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from broker import FleetClient
from broker.ops.replay import list_dead, replay, replay_ids
from broker.ops.supervisor import SupervisorSettings, build_worker, request_replay
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode
from tests.support import WorkerPool, run_cli, stop_supervisor, world_step
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


class BreakableEngine(NullEngine):
    """A null engine that fails every call while ``broken`` (a transient outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.calls = 0

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.calls += 1
        if self.broken:
            raise RuntimeError("device lost")
        return await super().run_batch(model, requests)



async def _dead_step(fleet: FleetClient, workers: WorkerPool) -> tuple[BreakableEngine, object]:
    engine = BreakableEngine()
    await workers.add(engine, max_attempts=3, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    engine.broken = True
    r = await s.step(1, **world_step(1))
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR and "device lost" in r.error.message
    assert r.attempt == 3 and r.committed_step_id == 0
    engine.broken = False
    return engine, s


async def test_a_step_that_keeps_failing_is_dead_lettered_with_reason_and_attempts(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    engine, s = await _dead_step(fleet, workers)
    assert engine.calls == 1 + 3  # step 0, then three attempts of step 1
    [dead] = await list_dead(scripts)
    assert (dead.session_id, dead.step_id, dead.code, dead.attempts) == (s.session_id, 1, "inference_error", 3)  # type: ignore[attr-defined]
    assert await list_dead(scripts, session="other") == []
    assert await list_dead(scripts, code="invalid_request") == []
    assert await list_dead(scripts, older_than_s=3600) == []
    assert len(await list_dead(scripts, newer_than_s=3600)) == 1


async def test_replay_commits_the_step_and_replaying_twice_is_harmless(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    _, s = await _dead_step(fleet, workers)
    [dry] = await replay(scripts, await list_dead(scripts), dry_run=True)
    assert dry.status == "dry_run" and len(await list_dead(scripts)) == 1
    [dead] = await list_dead(scripts)
    [outcome] = await replay_ids(scripts, [dead.entry_id])
    assert outcome.status == "queued"
    for _ in range(100):
        if (await s.status()).committed_step_id == 1:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.02)
    assert (await s.status()).committed_step_id == 1  # type: ignore[attr-defined]
    again = await s.step(1, **world_step(1))  # type: ignore[attr-defined]
    assert again.ok and again.duplicate and again.output["context"] == 1
    [twice] = await replay_ids(scripts, [dead.entry_id])
    assert twice.status == "not_found"
    assert await replay(scripts, await list_dead(scripts)) == []
    assert (await s.step(2, **world_step(2))).ok  # type: ignore[attr-defined]


async def test_replaying_a_step_committed_since_changes_nothing(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    _, s = await _dead_step(fleet, workers)
    first = await s.step(1, **world_step(1))  # type: ignore[attr-defined]
    assert first.ok
    [outcome] = await replay(scripts, await list_dead(scripts))
    assert outcome.status == "already_committed"
    assert (await s.status()).committed_step_id == 1  # type: ignore[attr-defined]
    stored = await s.step(1, **world_step(1))  # type: ignore[attr-defined]
    assert np.array_equal(stored.output["video_latent"], first.output["video_latent"])
    assert await list_dead(scripts) == []


async def test_invalid_input_is_never_retried_nor_dead_lettered(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    engine = BreakableEngine()
    await workers.add(engine, max_attempts=3, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **world_step(0, prompt="invalid"))
    assert r.error and r.error.code is ErrorCode.INVALID_REQUEST and engine.calls == 1
    assert await list_dead(scripts) == []


async def test_replay_cli_lists_and_runs(redis_server: RedisServer, prefix: str, fleet: FleetClient,
                                        workers: WorkerPool) -> None:
    _, s = await _dead_step(fleet, workers)
    base = [sys.executable, "-m", "cli.main", "replay", "--redis-url", redis_server.url, "--prefix", prefix]

    def run(*args: str) -> str:
        out = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    listed = await asyncio.to_thread(run, "list", "--code", "inference_error")
    assert "1 dead-lettered jobs" in listed and s.session_id in listed  # type: ignore[attr-defined]
    dry = await asyncio.to_thread(run, "run", "--dry-run")
    assert "dry_run" in dry
    done = await asyncio.to_thread(run, "run", "--session", s.session_id)  # type: ignore[attr-defined]
    assert "queued" in done
    assert "nothing to replay" in await asyncio.to_thread(run, "run")


async def test_supervisor_reaps_dead_workers_and_runs_replay_jobs(
    redis_server: RedisServer, prefix: str, fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    settings = SupervisorSettings(CellConfig(redis_url=redis_server.url, prefix=prefix, lease_ms=500))
    supervisors = [build_worker(settings, handle_signals=False) for _ in range(2)]  # two may run at once
    tasks = [asyncio.create_task(sv.async_run()) for sv in supervisors]
    try:
        a = await workers.add(NullEngine(), heartbeat_ms=100, lease_ms=500)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        assert (await s.step(0, **world_step(0))).ok
        b = await workers.add(NullEngine(), heartbeat_ms=100, lease_ms=500)
        await workers.kill(a)
        r = await asyncio.wait_for(s.step(1, **world_step(1)), 15)  # waits for the failover
        assert r.ok and r.worker_id == b.id and r.output["context"] == 1
        assert (await s.status()).epoch == 2
    finally:
        for sv, t in zip(supervisors, tasks, strict=True):
            await stop_supervisor(sv, t)


async def test_replay_requested_as_an_arq_job(
    redis_server: RedisServer, prefix: str, fleet: FleetClient, workers: WorkerPool, scripts: Scripts
) -> None:
    _, s = await _dead_step(fleet, workers)
    settings = SupervisorSettings(CellConfig(redis_url=redis_server.url, prefix=prefix))
    supervisor = build_worker(settings, handle_signals=False)
    task = asyncio.create_task(supervisor.async_run())
    try:
        await request_replay(settings, {"session": s.session_id})  # type: ignore[attr-defined]
        for _ in range(200):
            if (await s.status()).committed_step_id == 1:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.05)
        assert (await s.status()).committed_step_id == 1  # type: ignore[attr-defined]
        assert await list_dead(scripts) == []
    finally:
        await stop_supervisor(supervisor, task)


async def test_replay_cli_prints_a_missing_field_as_a_dash_and_an_unknown_id_as_sessions_show_does(
        redis_server: RedisServer, prefix: str, fleet: FleetClient, capsys: pytest.CaptureFixture[str]) -> None:
    # A worker's letter for an inbox entry it could not parse: no session, no step.
    entry_id = (await fleet.redis.xadd(fleet.keys.dead, {"reason": "malformed_job: no kind", "attempts": "1",
                                                         "inbox_entry_id": "1-1"})).decode()
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]
    code, out, _ = await run_cli(capsys, "replay", "list", *cell)
    row = next(line for line in out.splitlines() if line.startswith(entry_id))
    assert code == 0 and "None" not in out
    assert row.split()[1:4] == ["-", "-", "1"], row  # session, step, attempts
    code, out, _ = await run_cli(capsys, "replay", "run", entry_id, "--dry-run", *cell)
    assert code == 0 and "None" not in out and "not_replayable" in out
    code, out, _ = await run_cli(capsys, "replay", "list", "--json", *cell)
    assert '"step_id": null' in out  # JSON keeps its null
    for argv, says in (([entry_id[:-1] + "9"], f"replay show: not_found: dead letter '{entry_id[:-1]}9'"),
                       (["not-an-id"], "replay show: invalid_request: not a dead-letter entry id: 'not-an-id'"),
                       ([], "replay show: an ENTRY_ID is required")):
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli.main", "replay", "show", *argv,
                                                        *cell], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "", (argv, done.stdout)
        assert done.stderr.startswith(says) and len(done.stderr.strip().splitlines()) == 1, (argv, done.stderr)


async def test_a_replay_filter_from_the_environment_says_so(redis_server: RedisServer, prefix: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    env = {"ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix,
           "ROLLOUT_FLEET_CODE": "timeout", "ROLLOUT_FLEET_LIMIT": "5"}
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["replay", "list", "--limit", "9"], env) == 0
    err = capsys.readouterr().err
    assert err == "replay list: filtered by --code timeout (from $ROLLOUT_FLEET_CODE)\n"
