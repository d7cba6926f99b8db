"""The CLI verbs on a Redis Cluster, as a user runs them: a worker process, status, sessions
list/show/close, replay, update-weights and the demo, each given the cluster URL (one node away
from the cell, or every node)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from broker import FleetClient
from broker.redis.keys import CellKeys
from schemas.errors import ErrorCode
from tests.procs import Fleet
from tests.support import WorkerPool, world_step
from tests.support import run_cli as _cli
from tests.test_replay import BreakableEngine

pytestmark = pytest.mark.cluster
CLI = [sys.executable, "-m", "cli.main"]


async def test_worker_process_status_sessions_and_update_weights(
        cluster_url: str, prefix: str, fleet: FleetClient, capsys: pytest.CaptureFixture[str]) -> None:
    procs = Fleet(cluster_url, prefix)
    try:
        procs.worker()  # rollout-fleet worker --redis-url redis+cluster://...
        [worker_id] = await procs.wait_active(1)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        for i in range(3):
            assert (await s.step(i, **world_step(i))).committed_step_id == i
        cell = ["--redis-url", cluster_url, "--prefix", prefix]

        code, out, err = await _cli(capsys, "status", *cell, "--check")
        assert code == 0 and out.startswith("ok: 1 live worker(s), 1 session(s)"), out + err
        code, out, err = await _cli(capsys, "status", *cell, "--json")
        report = json.loads(out)
        assert code == 0, err
        assert report["live_workers"] == 1 and report["sessions"] == 1
        assert report["workers"][0]["worker_id"] == worker_id

        code, out, _ = await _cli(capsys, "sessions", "list", *cell, "--json")
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and [(r["session_id"], r["owner"], r["committed_step_id"]) for r in rows] == [
            (s.session_id, worker_id, 2)]
        code, out, _ = await _cli(capsys, "sessions", "show", s.session_id, *cell, "--json")
        assert code == 0 and json.loads(out)["committed_step_id"] == 2
        code, out, _ = await _cli(capsys, "sessions", "close", s.session_id, *cell, "--json")
        assert code == 0 and json.loads(out)["state"] in ("closing", "closed")
        closed = await s.step(3, **world_step(3))
        assert closed.error and closed.error.code is ErrorCode.SESSION_CLOSED

        code, out, err = await _cli(capsys, "update-weights", *cell, "--model", "null-world", "--version", "2",
                                    "--path", "/ckpt/v2")
        assert code == 0 and "version 2" in out, err
        control: list[tuple[bytes, dict[bytes, bytes]]] = await fleet.redis.xrange(CellKeys(prefix).control)
        assert [(f[b"model"], f[b"version"]) for _, f in control] == [(b"null-world", b"2")]
    finally:
        procs.close()


async def test_replay_lists_and_runs_dead_letters(cluster_url: str, prefix: str, fleet: FleetClient,
                                                  workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    engine = BreakableEngine()
    await workers.add(engine, max_attempts=2, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    engine.broken = True
    failed = await s.step(0, **world_step(0))
    assert failed.error and failed.error.code is ErrorCode.INFERENCE_ERROR
    engine.broken = False
    cell = ["--redis-url", cluster_url, "--prefix", prefix]
    code, out, _ = await _cli(capsys, "replay", "list", *cell)
    assert code == 0 and "1 dead-lettered jobs" in out and s.session_id in out
    code, out, _ = await _cli(capsys, "replay", "run", *cell, "--session", s.session_id)
    assert code == 0 and "queued" in out
    for _ in range(300):  # bounded: 30 s for the replayed step to commit
        if (await s.status()).committed_step_id == 0:
            break
        await asyncio.sleep(0.1)
    assert (await s.status()).committed_step_id == 0
    code, out, _ = await _cli(capsys, "replay", "run", *cell)
    assert code == 0 and "nothing to replay" in out


def test_demo_runs_on_the_cluster(cluster_url: str) -> None:
    out = subprocess.run([*CLI, "demo", "--redis-url", cluster_url, "--prefix", "demo", "--engine", "null",
                          "--workers", "2", "--sessions", "3", "--steps", "4", "--no-progress"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "lost=0" in out.stdout and "failed=0" in out.stdout, out.stdout[-2000:]


async def test_status_names_a_cluster_that_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = await _cli(capsys, "status", "--redis-url", "redis+cluster://fleet:pw9@127.0.0.1:1")
    assert code != 0 and "pw9" not in err and err.count("\n") == 1, err


def test_redis_cluster_command_serves_until_sigterm() -> None:
    proc = subprocess.Popen([*CLI, "redis", "--cluster"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # after the cluster is up: redis-cli --cluster create, first sync
        assert line.startswith("redis cluster listening at redis+cluster://"), line
        url = line.split(" at ", 1)[1].split(";", 1)[0]
        assert len(url.split(",")) == 6

        async def write_and_read() -> bytes | None:
            async with FleetClient(url, prefix="try") as fleet:
                await fleet.redis.set(fleet.keys.session("probe"), b"here", px=60_000)
                value: bytes | None = await fleet.redis.get(fleet.keys.session("probe"))
                return value

        assert asyncio.run(write_and_read()) == b"here"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0


async def test_every_cell_verbs_on_the_cluster(cluster_url: str, prefix: str, fleet: FleetClient,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`status --cell '*'`, `sessions list --cell '*'` and `cells` take the cluster URL (they built
    their own single-node clients before, and a redis+cluster:// URL was a traceback)."""
    procs = Fleet(cluster_url, prefix)
    try:
        procs.worker()
        [worker_id] = await procs.wait_active(1)
        s = await fleet.create_session(model="null-world", mode="world_model_env")
        assert (await s.step(0, **world_step(0))).committed_step_id == 0
        every = ["--redis-url", cluster_url, "--prefix", prefix, "--cell", "*"]

        code, out, err = await _cli(capsys, "status", *every, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert worker_id in json.dumps(report), out
        code, out, err = await _cli(capsys, "sessions", "list", *every, "--json")
        assert code == 0, err
        assert [json.loads(line)["session_id"] for line in out.splitlines()] == [s.session_id]
        code, out, err = await _cli(capsys, "cells", "--redis-url", cluster_url, "--prefix", prefix, "--json")
        assert code == 0, err
        rows = json.loads(out)["cells"]
        assert [r["cell"] for r in rows] == [CellKeys().cell] and rows[0]["live"] and rows[0]["master"], out
    finally:
        procs.close()
