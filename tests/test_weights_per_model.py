"""Weight versions are per model: an update of one model never changes another model's weights or
version (results, registry, gate); ``update-weights`` refuses a model no live worker serves and
reports a worker's stored error at once instead of waiting out ``--wait``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker import FleetClient
from broker.ops.weights import update_weights, workers_at_version
from broker.redis.embedded import RedisServer
from tests.support import WorkerPool, world_step
from tests.support import run_cli as _cli
from tests.test_metrics import scrape, value
from tests.test_weights import TOKENS, direct, engine
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


async def test_updating_the_lm_leaves_the_world_model_weights_and_version(
        fleet: FleetClient, workers: WorkerPool, tmp_path: Path) -> None:
    path = str(tmp_path / "v1.pt")
    engine(seed=1).save_weights(path)
    old, new = direct(0), direct(1)
    assert old[0] != new[0] and old[1] != new[1]
    w = await workers.add(engine())
    world = await fleet.create_session(model="reference-world", mode="world_model_env")
    lm = await fleet.create_session(model="reference-lm", mode="tokens")
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=path)
    await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1, timeout=30)
    t = await lm.step(0, use_session_context=False, **TOKENS)
    x = await world.step(0, use_session_context=False, **world_step(0))
    assert t.policy_version == 1 and list(t.output["token_ids"]) == new[1]
    assert x.policy_version == 0 and x.output["video_latent"].tobytes() == old[0]
    fields = await fleet.redis.hmget(fleet.keys.worker(w.id), ["policy_versions", "policy_version"])
    assert json.loads(fields[0]) == {"reference-lm": 1, "reference-world": 0}
    assert fields[1] == b"1"  # the engine-wide number: the highest
    # The world model then moves on its own, to its own version.
    await update_weights(fleet.redis, fleet.keys, model="reference-world", version=4, path=path)
    await workers_at_version(fleet.redis, fleet.keys, model="reference-world", version=4, timeout=30)
    x = await world.step(1, use_session_context=False, **world_step(0))
    t = await lm.step(1, use_session_context=False, **TOKENS)
    assert x.policy_version == 4 and x.output["video_latent"].tobytes() == new[0]
    assert t.policy_version == 1


async def test_a_minimum_version_waits_for_its_own_model(fleet: FleetClient, workers: WorkerPool) -> None:
    """null-lm at version 2 does not let a null-world step that needs version 2 through; the
    policy_version gauge is per model too."""
    w = await workers.add(NullEngine(), version_wait_s=0.3, metrics_port=0)
    world = await fleet.create_session(model="null-world", mode="world_model_env")
    await update_weights(fleet.redis, fleet.keys, model="null-lm", version=2, path="-")
    await workers_at_version(fleet.redis, fleet.keys, model="null-lm", version=2, timeout=30)
    port = w.worker.metrics.bound_port
    assert port is not None
    samples = await scrape(port)
    assert value(samples, "rollout_fleet_policy_version", model="null-lm") == 2
    assert value(samples, "rollout_fleet_policy_version", model="null-world") == 0
    r = await world.step(0, min_policy_version=2, **world_step(0))
    assert r.error and "policy version 2" in r.error.message and "version 0" in r.error.message
    await update_weights(fleet.redis, fleet.keys, model="null-world", version=2, path="-")
    r = await world.step(0, min_policy_version=2, **world_step(0))
    assert r.ok and r.policy_version == 2


async def test_update_weights_refuses_a_model_no_live_worker_serves(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    await workers.add(NullEngine())
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]
    code, out, err = await _cli(capsys, "update-weights", *cell, "--model", "reference-lm", "--version", "2",
                                "--path", "/x")
    assert code == 2 and out == ""
    assert err.strip() == ("update-weights: no live worker serves model 'reference-lm' (live workers serve: "
                           "null-lm, null-world; --allow-unserved announces it anyway)")
    code, out, _ = await _cli(capsys, "update-weights", *cell, "--model", "null-lm", "--version", "2",
                              "--path", "/x", "--wait", "30")
    assert code == 0 and "1 workers serve version 2" in out


async def test_update_weights_reports_a_workers_stored_error_at_once(
        workers: WorkerPool, redis_server: RedisServer, prefix: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(engine(), heartbeat_ms=100)
    missing = str(tmp_path / "missing.pt")
    cell = ["--redis-url", redis_server.url, "--prefix", prefix]
    # --wait is far longer than the test's own bound: only the stored error can end it in time.
    run = _cli(capsys, "update-weights", *cell, "--model", "reference-lm", "--version", "2", "--path", missing,
               "--wait", "3600")
    code, out, err = await asyncio.wait_for(run, 60)
    assert code == 1 and "announced reference-lm version 2" in out
    last = err.strip().splitlines()[-1]  # after the log lines (stderr too)
    assert last.startswith(f"update-weights: failed: worker {w.id}: reference-lm version 2: FileNotFoundError")
    assert w.worker.engine.policy_versions() == {"reference-world": 0, "reference-lm": 0}
