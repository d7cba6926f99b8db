"""``rollout-fleet status``: --json, --check (no live worker, a dead letter within the window,
healthy), --watch until Ctrl-C, and Redis down, against a real Redis and in-process workers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode
from tests.support import WorkerPool, run_cli, world_step
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine

CLI = [sys.executable, "-m", "cli.main"]


class BrokenEngine(NullEngine):
    """Fails every batch: its steps end in the dead-letter stream."""

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        raise RuntimeError("device lost")


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The CLI's exit code and stdout."""
    code, out, _ = await run_cli(capsys, *argv)
    return code, out


async def _cli_until(capsys: pytest.CaptureFixture[str], done: Callable[[str], bool], *argv: str) -> tuple[int, str]:
    """The CLI again until its output shows the next heartbeat's fields (at most 6 s)."""
    for _ in range(30):
        code, out = await _cli(capsys, *argv)
        if done(out):
            break
        await asyncio.sleep(0.2)
    return code, out


def _cell(url: str, prefix: str) -> list[str]:
    return ["--redis-url", url, "--prefix", prefix]


@pytest.mark.asyncio
async def test_json_reports_each_worker_with_its_registry_fields(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(NullEngine(), capacity=7, heartbeat_ms=100)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    code, out = await _cli_until(capsys, lambda out: '"committed_steps": "1"' in out,
                                 "status", *_cell(redis_server.url, prefix), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["sessions"] == 1 and report["dead_letters"] == 0 and report["live_workers"] == 1
    [worker] = report["workers"]
    assert worker["worker_id"] == w.id and worker["live"] is True and worker["state"] == "active"
    assert worker["engine"] == "null" and worker["models"] == ["null-world", "null-lm"]
    assert worker["capacity"] == 7 and worker["load"] == 1 and worker["policy_version"] == 0
    assert worker["weights_error"] == "" and worker["inbox_pending"] == 0
    assert worker["policy_versions"] == {"null-world": 0, "null-lm": 0}
    assert worker["registry"]["committed_steps"] == "1"  # every registry field, as published


@pytest.mark.asyncio
async def test_table_shows_engine_models_version_and_weights_error(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(NullEngine(), heartbeat_ms=100)
    assert w.worker.weights is not None
    w.worker.weights.error = "version 3: OSError: no such file"  # as a failed update leaves it
    code, out = await _cli_until(capsys, lambda out: "weights error" in out, "status",
                                 *_cell(redis_server.url, prefix))
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(w.id))
    assert "null" in row and " 0 null-world@0,null-lm@0 " in row and row.endswith(" yes")
    assert "weights error: version 3: OSError: no such file" in out


@pytest.mark.asyncio
async def test_check_fails_without_a_live_worker(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["status", *_cell(redis_server.url, prefix), "--lease-ms", "300", "--check"]
    code, out = await _cli(capsys, *argv)
    assert code == 1 and out.strip() == "unhealthy: no live worker (0 registered, lease 300 ms)"
    w = await workers.add(NullEngine(), heartbeat_ms=100)
    code, out = await _cli(capsys, *argv)
    assert code == 0 and out.startswith("ok: 1 live worker(s)")
    await workers.kill(w)  # registered still, silent: not live once its heartbeat is older than the lease
    code, out = await _cli_until(capsys, lambda out: "unhealthy" in out, *argv)
    assert code == 1 and out.strip() == "unhealthy: no live worker (1 registered, lease 300 ms)"


@pytest.mark.asyncio
async def test_check_passes_when_healthy_and_fails_after_a_dead_letter(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    await workers.add(NullEngine())
    code, out = await _cli(capsys, "status", *_cell(redis_server.url, prefix), "--check")
    assert code == 0 and out.startswith("ok: 1 live worker(s), 0 session(s)")
    await workers.add(BrokenEngine(), max_attempts=1)
    await workers.stop(workers.running[0])  # the broken one takes the next session
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await s.step(0, **world_step(0))
    assert r.error and r.error.code is ErrorCode.INFERENCE_ERROR
    code, out = await _cli(capsys, "status", *_cell(redis_server.url, prefix), "--check")
    assert code == 1
    assert out.startswith("unhealthy: dead letter(s) within the last 300 s, the newest "), out
    assert "(1 kept; see 'rollout-fleet replay list')" in out
    # A window that ends before the letter was written passes (the worker is live, no engine flag).
    await asyncio.sleep(0.3)
    code, out = await _cli(capsys, "status", *_cell(redis_server.url, prefix), "--check", "--window", "0.1")
    assert code == 0 and out.startswith("ok: 1 live worker(s), 1 session(s)"), out


class UnreadyEngine(NullEngine):
    """An engine whose server is down: its readiness probe says why."""

    async def ready(self) -> bool:
        raise ConnectionError("vLLM server at 127.0.0.1:1 refused the connection")


@pytest.mark.asyncio
async def test_check_fails_when_a_live_worker_says_its_engine_is_not_ready(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(UnreadyEngine(), heartbeat_ms=100)
    argv = ["status", "--redis-url", redis_server.url, "--prefix", prefix]
    code, out = await _cli_until(capsys, lambda out: "unhealthy: engine" in out, *argv, "--check")
    assert code == 1 and out.strip() == (f"unhealthy: engine not ready on 1 live worker(s): {w.id} "
                                         "(ConnectionError: vLLM server at 127.0.0.1:1 refused the connection)")
    code, out = await _cli(capsys, *argv)
    assert code == 0 and "NO (ConnectionError: vLLM server at 127.0.0.1:1 refused the connection)" in out
    code, out = await _cli(capsys, *argv, "--json")
    assert json.loads(out)["workers"][0]["registry"]["engine_ready"] == "0"


class MultiLineEngine(NullEngine):
    """A readiness probe whose exception text spans lines (a server's error page, a chained cause)."""

    async def ready(self) -> bool:
        raise RuntimeError("vLLM server answered 500:\n<html>\n  loading\n</html>")


@pytest.mark.asyncio
async def test_check_answers_in_one_line_when_the_engines_reason_spans_lines(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(MultiLineEngine(), heartbeat_ms=100)
    argv = ["status", "--redis-url", redis_server.url, "--prefix", prefix, "--check"]
    code, out = await _cli_until(capsys, lambda out: "unhealthy: engine" in out, *argv)
    assert code == 1 and out.splitlines() == [f"unhealthy: engine not ready on 1 live worker(s): {w.id} "
                                              "(RuntimeError: vLLM server answered 500: <html> loading </html>)"], out


def test_status_without_redis_is_one_line_and_exit_2() -> None:
    url = "redis://fleet:hunter2@127.0.0.1:1/0"
    for flags in ([], ["--json"], ["--check"]):
        out = subprocess.run([*CLI, "status", "--redis-url", url, *flags], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2
        assert out.stderr.startswith("rollout-fleet status: error: Redis at redis://fleet:***@127.0.0.1:1/0 "
                                     "did not answer"), out.stderr
        assert "Traceback" not in out.stderr and "hunter2" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_watch_redraws_until_interrupted(redis_server: RedisServer) -> None:
    proc = subprocess.Popen([*CLI, "status", *_cell(redis_server.url, "watched"), "--watch", "0.1", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        frames = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert all(f["sessions"] == 0 for f in frames)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "Traceback" not in err


def test_a_bad_watch_interval_is_refused() -> None:
    out = subprocess.run([*CLI, "status", "--watch", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be positive" in out.stderr and "Traceback" not in out.stderr
