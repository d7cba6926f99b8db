"""Operations over every cell (``--cell '*'``) on one Redis: the supervisor's passes, status,
sessions, replay, update-weights, the cells verb, and a gateway of every cell routing by id."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from broker import FleetClient
from broker.client.session import Session
from broker.gateway.settings import GatewaySettings
from broker.ops.fleet_dashboard import FleetDashboardSource
from broker.ops.metrics import FleetMetrics
from broker.ops.status import fleet_status
from broker.ops.supervisor import SupervisorSettings, reap_job, replay_dead, trim_job
from broker.ops.weights import update_weights_in_cells
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from broker.redis.slots import cell_slot
from cli.main import parse_invocation
from tests.support import FAST, WorkerPool, world_step
from tests.support import run_cli as _cli
from tests.test_gateway import SESSIONS, GatewayServer, body
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio
CELLS = ("a", "b")
WORKER = {"heartbeat_ms": FAST["heartbeat_ms"], "lease_ms": FAST["lease_ms"], "reap": False, "max_attempts": 1}


@pytest.fixture
async def anywhere(redis_server: RedisServer, prefix: str) -> AsyncIterator[FleetClient]:
    async with FleetClient(redis_server.url, prefix=prefix, cell="*", lease_ms=FAST["lease_ms"]) as client:
        yield client


async def two_cells(workers: WorkerPool, anywhere: FleetClient) -> dict[str, Session]:
    """Two workers in each of cells a and b; one session in each cell, its step 0 committed and
    a failed step dead-lettered."""
    for cell in CELLS:
        for _ in range(2):
            await workers.add(NullEngine(), cell=cell, **WORKER)
    sessions = {}
    for cell in CELLS:
        s = await anywhere.create_session(model="null-world", mode="world_model_env", session_id=f"ep@{cell}")
        assert (await s.step(0, **world_step(0))).ok
        assert not (await s.step(1, **world_step(1, prompt="fail"))).ok
        sessions[cell] = s
    return sessions


async def test_supervisor_passes_cover_every_cell(workers: WorkerPool, anywhere: FleetClient,
                                                  redis_server: RedisServer, prefix: str) -> None:
    sessions = await two_cells(workers, anywhere)
    config = CellConfig(redis_url=redis_server.url, prefix=prefix, cell="*", lease_ms=FAST["lease_ms"])
    redis = Redis.from_url(redis_server.url)
    ctx: dict[str, Any] = {"settings": SupervisorSettings(cell_config=config), "fleet_redis": redis,
                           "metrics": FleetMetrics()}
    try:
        outcomes = await replay_dead(ctx, {}, dry_run=True)
        assert sorted(o["session_id"] for o in outcomes) == ["ep@a", "ep@b"]
        for s in sessions.values():
            await workers.kill(next(w for w in workers.running if w.id == s.owner))
        moved: set[str] = set()
        deadline = time.monotonic() + 15.0
        while moved != {"ep@a", "ep@b"}:
            assert time.monotonic() < deadline, f"sessions moved so far: {moved}"
            await asyncio.sleep(0.1)
            done = await reap_job(ctx)
            moved |= {sid for report in done["workers"] for sid in report["moved"]}
        for s in sessions.values():
            assert (await anywhere.status(s.session_id)).owner != s.owner
        for cell in CELLS:  # as if both sessions had expired: the trim pass forgets them in each cell
            await redis.delete(CellKeys(prefix, cell).session(f"ep@{cell}"))
        assert (await trim_job(ctx))["sessions_forgotten"] == 2
    finally:
        await redis.aclose()


async def test_status_sessions_and_replay_cover_every_cell(workers: WorkerPool, anywhere: FleetClient,
                                                           redis_server: RedisServer, prefix: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    await two_cells(workers, anywhere)
    config = CellConfig(redis_url=redis_server.url, prefix=prefix, cell="*", lease_ms=FAST["lease_ms"])
    reports = await fleet_status(config)
    assert sorted(reports) == ["a", "b"]
    assert all(len(r.workers) == 2 and r.live_sessions == 1 and r.dead_letters == 1 for r in reports.values())
    every = ["--redis-url", redis_server.url, "--prefix", prefix, "--cell", "*"]
    code, out, _ = await _cli(capsys, "status", *every, "--json")
    assert code == 0 and sorted(json.loads(out)["cells"]) == ["a", "b"]
    code, out, _ = await _cli(capsys, "status", *every)
    assert code == 0 and "cell a:" in out and "cell b:" in out
    code, out, _ = await _cli(capsys, "status", *every, "--check", "--window", "1000")
    assert code == 1 and "cell a: dead letter(s)" in out and "cell b: dead letter(s)" in out
    code, out, _ = await _cli(capsys, "sessions", *every, "list", "--json")
    assert code == 0 and sorted(json.loads(line)["session_id"] for line in out.splitlines()) == ["ep@a", "ep@b"]
    code, out, _ = await _cli(capsys, "sessions", *every, "show", "ep@b", "--json")
    assert code == 0 and json.loads(out)["committed_step_id"] == 0
    code, _, err = await _cli(capsys, "sessions", *every[:-1], "a", "show", "ep@b")
    assert code == 2 and "is in cell 'b', not in cell 'a'" in err
    code, out, _ = await _cli(capsys, "replay", *every, "list", "--json")
    assert code == 0 and sorted(json.loads(line)["session_id"] for line in out.splitlines()) == ["ep@a", "ep@b"]
    code, out, _ = await _cli(capsys, "sessions", *every, "close", "ep@a", "--json")
    assert code == 0 and json.loads(out)["state"] in ("closing", "closed")
    assert (await anywhere.status("ep@a")).closed and not (await anywhere.status("ep@b")).closed


async def test_update_weights_announces_in_every_cell(workers: WorkerPool, anywhere: FleetClient,
                                                      redis_server: RedisServer, prefix: str) -> None:
    await two_cells(workers, anywhere)
    config = CellConfig(redis_url=redis_server.url, prefix=prefix, cell="*", lease_ms=FAST["lease_ms"])
    said: list[str] = []
    with pytest.raises(ValueError, match="no live worker serves model 'nope'"):
        await update_weights_in_cells(anywhere.redis, config, model="nope", version=1, path="/w", say=said.append)
    assert said == []
    for cell in CELLS:
        assert await anywhere.redis.xlen(CellKeys(prefix, cell).control) == 0  # the refusal announced nothing
    await update_weights_in_cells(anywhere.redis, config, model="nope", version=1, path="/w", allow_unserved=True,
                                  say=said.append)
    assert [line.rsplit(" ", 3)[1:] for line in said] == [["in", "cell", "a"], ["in", "cell", "b"]]
    for cell in CELLS:
        assert await anywhere.redis.xlen(CellKeys(prefix, cell).control) == 1


async def test_cells_verb_lists_and_suggests(workers: WorkerPool, anywhere: FleetClient, redis_server: RedisServer,
                                             prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    await two_cells(workers, anywhere)
    where = ["--redis-url", redis_server.url, "--prefix", prefix, "--lease-ms", str(FAST["lease_ms"])]
    code, out, _ = await _cli(capsys, "cells", *where, "--json")
    rows = json.loads(out)["cells"]
    assert code == 0 and [(r["cell"], r["slot"], r["live"]) for r in rows] == [
        ("a", cell_slot("a"), True), ("b", cell_slot("b"), True)]
    code, out, _ = await _cli(capsys, "cells", *where, "suggest", "--count", "1", "--stem", "gpu")
    assert code == 0 and out.split()[0] == "gpu0"
    code, _, err = await _cli(capsys, "cells", *where, "suggest", "--count", "2")
    assert code == 2 and "need 2 masters; the cluster has 1" in err
    code, _, err = await _cli(capsys, "cells", *where, "suggest", "--stem", "a@")
    assert code == 2 and "makes no cell name" in err


@pytest.mark.parametrize("verb", ["worker", "demo"])
async def test_a_worker_joins_one_cell(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, env in (([verb, "--cell", "*"], {}), ([verb], {"ROLLOUT_FLEET_CELL": "*"})):
        with pytest.raises(SystemExit) as exit_info:
            parse_invocation(argv, env)
        assert exit_info.value.code == 2 and f"a {verb} joins one cell" in capsys.readouterr().err


async def test_a_gateway_of_every_cell_routes_by_id(workers: WorkerPool, anywhere: FleetClient,
                                                    redis_server: RedisServer, prefix: str) -> None:
    sessions = await two_cells(workers, anywhere)
    async with GatewayServer(redis_server.url, prefix, cell="*") as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        assert (await http.get("/health")).status_code == 503  # no cell serves the default model
        for s in sessions.values():
            r = await http.post(f"{SESSIONS}/{s.session_id}/step", json=body(1))
            assert r.status_code == 200, r.text
            assert (await http.get(f"{SESSIONS}/{s.session_id}/status")).json()["committed_step_id"] == 1
            assert (await anywhere.status(s.session_id)).committed_step_id == 1
        assert (await http.post(f"{SESSIONS}/nobody@a/step", json=body(0))).status_code == 404
    async with GatewayServer(redis_server.url, prefix, cell="a") as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        assert (await http.get(f"{SESSIONS}/ep@a/status")).json()["committed_step_id"] == 1
        for method, route in (("GET", "status"), ("POST", "reset"), ("POST", "close"), ("POST", "step")):
            r = await http.request(method, f"{SESSIONS}/ep@b/{route}", json=body(2) if route == "step" else None)
            assert r.status_code == 400 and "stays in cell 'a'" in r.text, (route, r.text)
    assert not (await anywhere.status("ep@b")).closed  # the refused calls changed nothing


async def test_a_gateway_of_every_cell_counts_a_keys_sessions_over_cells(workers: WorkerPool, anywhere: FleetClient,
                                                                        redis_server: RedisServer,
                                                                        prefix: str) -> None:
    await two_cells(workers, anywhere)
    settings = GatewaySettings(api_keys=frozenset({"k1", "k2"}), max_sessions_per_key=2)
    async with GatewayServer(redis_server.url, prefix, cell="*", settings=settings) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0, headers={"Authorization": "Bearer k1"}) as http:
        ids = []
        for _ in range(2):
            created = await http.post(SESSIONS, json={"model": "null-world"})
            assert created.status_code == 200, created.text
            ids.append(created.json()["session_id"])
        assert sorted(sid.rsplit("@", 1)[1] for sid in ids) == ["a", "b"]  # equal room: a, then b
        for sid in ids:
            assert (await http.post(f"{SESSIONS}/{sid}/step", json=body(0))).status_code == 200
            other = await http.get(f"{SESSIONS}/{sid}/status", headers={"Authorization": "Bearer k2"})
            assert other.status_code == 403
        assert (await http.post(SESSIONS, json={"model": "null-world"})).status_code == 429  # the cap spans cells
        assert (await http.post(f"{SESSIONS}/{ids[0]}/close")).status_code == 200
        assert (await http.post(SESSIONS, json={"model": "null-world"})).status_code == 200


async def test_the_dashboard_of_every_cell_adds_the_cells_up(workers: WorkerPool, anywhere: FleetClient,
                                                             redis_server: RedisServer, prefix: str) -> None:
    await two_cells(workers, anywhere)
    config = CellConfig(redis_url=redis_server.url, prefix=prefix, cell="*", lease_ms=FAST["lease_ms"])
    source = FleetDashboardSource(anywhere.redis, config)
    snapshot = await source.snapshot()
    assert sorted(w["cell"] for w in snapshot["workers"]) == ["a", "a", "b", "b"]
    assert snapshot["sessions"]["total"] == 2
    letters = snapshot["dead_letters"]
    assert letters["total"] == 2 and sorted(j["cell"] for j in letters["shown"]) == ["a", "b"]
    in_b = next(j for j in letters["shown"] if j["cell"] == "b")
    outcome = await source.replay(in_b["entry_id"])
    assert outcome["session_id"] == "ep@b" and outcome["status"] == "queued"
    assert (await source.replay("1-0"))["status"] == "not_found"
    deadline = time.monotonic() + 15.0  # each cell's workers publish their step summaries every 5 heartbeats
    while (stats := (await source.snapshot())["stats"])["committed"] < 2:
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.3)
    assert stats["committed"] == 2 and stats["reporting_workers"] == 2 and stats["p50_ms"] is not None
