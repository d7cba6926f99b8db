"""``rollout-fleet sessions list|show|close`` against a real Redis and in-process workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode
from tests.support import WorkerPool, world_step
from tests.support import run_cli as _cli
from workers.engines.null import NullEngine

CLI = [sys.executable, "-m", "cli.main"]


@pytest.mark.asyncio
async def test_list_filters_by_model_owner_and_state(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    w1 = await workers.add(NullEngine(), capacity=2)
    world = await fleet.create_session(model="null-world", mode="world_model_env")
    lm = await fleet.create_session(model="null-lm", mode="tokens")
    w2 = await workers.add(NullEngine(), capacity=2)
    other = await fleet.create_session(model="null-world", mode="world_model_env")
    assert {world.owner, lm.owner} == {w1.id} and other.owner == w2.id
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]

    async def listed(*flags: str) -> list[dict[str, object]]:
        code, out, _ = await _cli(capsys, "sessions", "list", *cell, "--json", *flags)
        assert code == 0
        return [json.loads(line) for line in out.splitlines()]

    assert {r["session_id"] for r in await listed()} == {world.session_id, lm.session_id, other.session_id}
    assert {r["session_id"] for r in await listed("--model", "null-world")} == {world.session_id, other.session_id}
    assert {r["session_id"] for r in await listed("--owner", w2.id)} == {other.session_id}
    assert {r["state"] for r in await listed()} == {"open"}
    await lm.close()
    states = {r["session_id"]: r["state"] for r in await listed()}
    assert states[lm.session_id] in ("closing", "closed")
    assert {r["session_id"] for r in await listed("--state", "open")} == {world.session_id, other.session_id}
    assert len(await listed("--limit", "1")) == 1
    code, out, _ = await _cli(capsys, "sessions", "list", *cell)
    assert code == 0 and out.splitlines()[-1] == "3 sessions" and world.session_id in out


@pytest.mark.asyncio
async def test_show_prints_the_step_window_owner_epoch_version_and_idle_time(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env", result_window=2)
    for i in range(3):
        assert (await s.step(i, **world_step(i))).ok
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]
    code, out, _ = await _cli(capsys, "sessions", "show", s.session_id, *cell, "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["state"], d["owner"], d["epoch"], d["model"], d["mode"]) == ("open", w.id, 1, "null-world",
                                                                          "world_model_env")
    assert (d["committed_step_id"], d["next_step_id"]) == (2, 3)
    assert d["results"] == [1, 2] and d["inputs"] == [0, 2]  # window 2; full retention keeps every record
    assert d["policy_version"] == 0 and d["idle_ms"] >= 0 and d["idle_timeout_ms"] == 3_600_000
    code, out, _ = await _cli(capsys, "sessions", "show", s.session_id, *cell)
    assert code == 0 and f"owner {w.id}, epoch 1" in out and "stored results 1..2 (window 2)" in out
    assert "policy version 0 (last committed step)" in out and "closes after 3600 s idle" in out


@pytest.mark.asyncio
async def test_close_goes_through_the_close_path_and_later_steps_are_refused(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]
    code, out, _ = await _cli(capsys, "sessions", "close", s.session_id, *cell, "--json")
    assert code == 0 and json.loads(out)["state"] in ("closing", "closed")
    st = await s.status()
    assert st.closed and st.committed_step_id == 0
    r = await s.step(1, **world_step(1))
    assert r.error and r.error.code is ErrorCode.SESSION_CLOSED
    code, out, _ = await _cli(capsys, "sessions", "close", s.session_id, *cell)  # closing twice is fine
    assert code == 0


def test_unknown_and_invalid_sessions_are_one_line_and_exit_2(redis_server: RedisServer) -> None:
    cell = ["--redis-url", redis_server.url, "--prefix", "nosessions"]
    for action, sid, text in (("show", "s-nope", "session_not_found: session 's-nope' does not exist"),
                              ("close", "s-nope", "session_not_found: session 's-nope' does not exist"),
                              ("show", "a:b", "invalid_request"), ("show", "", "a SESSION_ID is required")):
        out = subprocess.run([*CLI, "sessions", action, *([sid] if sid else []), *cell], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, (action, sid, out.stderr)
        assert text in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_a_bad_state_filter_is_refused() -> None:
    out = subprocess.run([*CLI, "sessions", "list", "--state", "sleeping"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "invalid choice: 'sleeping'" in out.stderr


def test_sessions_without_redis_is_one_line_without_the_password() -> None:
    url = "redis://fleet:hunter2@127.0.0.1:1/0"
    for argv in (["list"], ["show", "s-1"], ["close", "s-1"]):
        out = subprocess.run([*CLI, "sessions", *argv, "--redis-url", url], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("rollout-fleet sessions: error: Redis at redis://fleet:***@127.0.0.1:1/0")
        assert "hunter2" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.asyncio
async def test_a_filter_from_the_environment_says_so(
        fleet: FleetClient, workers: WorkerPool, redis_server: RedisServer, prefix: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """$ROLLOUT_FLEET_MODEL exported for the gateway filters `sessions list` too: it must say so."""
    from cli.main import main

    await workers.add(NullEngine(), capacity=4)
    world = await fleet.create_session(model="null-world", mode="world_model_env")
    await fleet.create_session(model="null-lm", mode="tokens")
    env = {"ROLLOUT_FLEET_REDIS_URL": redis_server.url, "ROLLOUT_FLEET_PREFIX": prefix,
           "ROLLOUT_FLEET_MODEL": "null-world"}

    async def listed(*flags: str) -> tuple[list[str], str]:
        capsys.readouterr()
        assert await asyncio.to_thread(main, ["sessions", "list", *flags], env) == 0
        captured = capsys.readouterr()
        return captured.out.splitlines(), captured.err

    out, err = await listed()
    assert out[-1] == "1 sessions" and world.session_id in out[1]
    assert err == "sessions list: filtered by --model null-world (from $ROLLOUT_FLEET_MODEL)\n"
    out, err = await listed("--model", "null-lm")  # the flag: said on the command line already
    assert out[-1] == "1 sessions" and err == ""
