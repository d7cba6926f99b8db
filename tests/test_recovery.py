"""Recovery that does not grow with the session: a token session is rebuilt in one prefill of its
recorded tokens; a world session from its latest snapshot plus the steps after it (a corrupt
snapshot falls back to the full replay); either way the results match a fault-free run bit for bit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from broker import FleetClient, Session
from broker.ops.failover import redis_now_ms
from broker.ops.weights import update_weights, workers_at_version
from broker.redis.embedded import RedisServer
from broker.redis.layouts import LOG_SNAPSHOT_FIELD, log_input_field
from broker.redis.scripts import Scripts
from cli.processes import spawn_worker
from schemas.codec import decode, encode
from schemas.messages import StepResult, TokenStep, WorldStep
from tests.procs import Fleet
from tests.support import FAST, RunningWorker, WorkerPool, reap_until_moved, world_step
from workers.engines.base import EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig
from workers.reaper import EXPIRY_MARGIN_S, until_next_expiry_s
from workers.rebuild import BLAKE2B_16, XXH3_128, load_snapshot, one_prefill, output_digest, pack

pytestmark = pytest.mark.asyncio
SHAPE = (1, 4, 2, 8, 10)


def ref(seed: int = 0) -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, seed=seed))


def turn(i: int) -> dict[str, Any]:
    return {"token_ids": [3 + (5 * i + j) % 200 for j in range(2 + i % 3)],
            "sampling": {"max_tokens": 3 + i % 4, "temperature": 0.9, "seed": i}}


async def pair(fleet: FleetClient, workers: WorkerPool, model: str, mode: str,
               **settings: Any) -> tuple[RunningWorker, RunningWorker, Session, Session]:
    """A session on worker a and its fault-free twin on worker b."""
    a = await workers.add(ref(), **FAST, **settings)
    s = await fleet.create_session(model=model, mode=mode)
    b = await workers.add(ref(), **FAST, **settings)
    twin = await fleet.create_session(model=model, mode=mode)
    assert s.owner == a.id and twin.owner == b.id
    return a, b, s, twin


async def world_steps(s: Session, twin: Session, steps: range) -> None:
    for i in steps:
        r, c = await asyncio.gather(s.step(i, **world_step(i)), twin.step(i, **world_step(i)))
        assert r.ok and c.ok, (r.error, c.error)
        assert np.array_equal(r.output["video_latent"], c.output["video_latent"]), i


async def kill(workers: WorkerPool, scripts: Scripts, dead: RunningWorker) -> None:
    await workers.kill(dead)
    await reap_until_moved(scripts, dead.id)


async def test_a_world_session_restores_its_snapshot_and_replays_at_most_n_steps(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    a, b, s, twin = await pair(fleet, workers, "reference-world", "world_model_env", snapshot_every=8)
    await world_steps(s, twin, range(37))  # snapshots after steps 7, 15, 23 and 31
    assert a.worker.executor.snapshots.written == 4
    await kill(workers, scripts, a)
    await world_steps(s, twin, range(37, 40))
    assert s.owner == b.id
    assert b.worker.executor.replayed_steps == 5  # steps 32..36, after the snapshot of step 31
    assert b.worker.executor.rebuild_engine_calls == 5 and b.worker.executor.rebuilt_steps == 37


async def test_a_corrupt_snapshot_falls_back_to_the_full_replay(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    a, b, s, twin = await pair(fleet, workers, "reference-world", "world_model_env", snapshot_every=4)
    await world_steps(s, twin, range(10))
    log_key = fleet.keys.log(s.session_id)
    stored = await fleet.redis.hget(log_key, LOG_SNAPSHOT_FIELD)
    assert stored is not None
    fields = decode(stored)
    fields["state"] = fields["state"][:-1] + bytes([fields["state"][-1] ^ 1])  # one bit of the state lost
    await fleet.redis.hset(log_key, LOG_SNAPSHOT_FIELD, encode(fields))
    await kill(workers, scripts, a)
    await world_steps(s, twin, range(10, 12))
    assert b.worker.executor.replayed_steps == 10  # every step, as without snapshots


async def _rewrite_records(fleet: FleetClient, s: Session, outputs: list[dict[str, Any]],
                           digest: Any) -> None:
    """Every step record of ``s`` as an earlier release wrote it: no digest_kind, ``digest(i, output)``."""
    log_key = fleet.keys.log(s.session_id)
    for i, output in enumerate(outputs):
        record = decode(await fleet.redis.hget(log_key, log_input_field(i)))
        assert record.pop("digest_kind") == XXH3_128
        assert record["digest"] == output_digest(output, XXH3_128)  # the trainer sees what was digested
        record["digest"] = digest(i, output)
        await fleet.redis.hset(log_key, log_input_field(i), encode(record))


@pytest.mark.parametrize("tampered", [False, True])
async def test_records_of_an_earlier_release_replay_checked_by_their_blake2b_digests(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts, tampered: bool) -> None:
    a, b, s, twin = await pair(fleet, workers, "reference-world", "world_model_env", snapshot_every=0)
    outputs = []
    for i in range(6):
        r, c = await asyncio.gather(s.step(i, **world_step(i)), twin.step(i, **world_step(i)))
        assert r.ok and c.ok, (r.error, c.error)
        outputs.append(r.output)

    def legacy(i: int, output: dict[str, Any]) -> bytes:
        good = output_digest(output, BLAKE2B_16)
        return bytes([good[0] ^ 1]) + good[1:] if tampered and i == 3 else good

    await _rewrite_records(fleet, s, outputs, legacy)
    await kill(workers, scripts, a)
    r = await s.step(6, **world_step(6))
    if tampered:  # the legacy digest is really checked: step 3's replay no longer matches it
        assert not r.ok and r.error is not None and r.error.code == "context_lost", r.error
        assert "replayed step 3 differs" in r.error.message
        return
    c = await twin.step(6, **world_step(6))
    assert r.ok and c.ok and s.owner == b.id, (r.error, c.error)
    assert np.array_equal(r.output["video_latent"], c.output["video_latent"])
    assert b.worker.executor.replayed_steps == 6


async def test_a_snapshot_covers_the_steps_a_last_n_retention_dropped(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    a = await workers.add(ref(), **FAST, snapshot_every=4)
    s = await fleet.create_session(model="reference-world", mode="world_model_env", retention="last:4")
    b = await workers.add(ref(), **FAST, snapshot_every=4)
    twin = await fleet.create_session(model="reference-world", mode="world_model_env")
    await world_steps(s, twin, range(10))  # inputs of steps 6..9 kept; the snapshot of step 7
    await kill(workers, scripts, a)
    await world_steps(s, twin, range(10, 12))
    assert b.worker.executor.replayed_steps == 2


async def test_a_reset_drops_the_snapshot_and_a_stale_one_is_never_written(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    a = await workers.add(ref(), **FAST, snapshot_every=2)
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    for i in range(4):
        assert (await s.step(i, **world_step(i))).ok
    log_key = fleet.keys.log(s.session_id)
    assert await fleet.redis.hexists(log_key, LOG_SNAPSHOT_FIELD)
    assert await s.reset() == -1
    assert not await fleet.redis.exists(log_key)
    status = await s.status()
    # A late write for the old gen (or a step not committed) is refused by snapshot.lua.
    stale = dict(session_id=s.session_id, worker_id=a.id, epoch=status.epoch, snapshot=b"x")
    assert not await scripts.save_snapshot(step_id=3, gen=0, **stale)
    assert not await fleet.redis.exists(log_key)
    assert (await s.step(0, **world_step(0))).ok
    assert not await scripts.save_snapshot(step_id=1, gen=1, **stale)  # step 1 is not committed


async def test_a_token_session_is_rebuilt_in_one_prefill_with_the_same_results(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    a, b, t, twin = await pair(fleet, workers, "reference-lm", "tokens")
    for i in range(12):
        r, c = await asyncio.gather(t.step(i, **turn(i)), twin.step(i, **turn(i)))
        assert r.ok and c.ok and r.output["token_ids"] == c.output["token_ids"]
    await kill(workers, scripts, a)
    for i in range(12, 15):
        r, c = await asyncio.gather(t.step(i, **turn(i)), twin.step(i, **turn(i)))
        assert r.ok and r.worker_id == b.id, r.error
        assert r.output["token_ids"] == c.output["token_ids"] and r.output["logprobs"] == c.output["logprobs"]
        assert r.context_length == c.context_length
    assert b.worker.executor.rebuild_engine_calls == 1 and b.worker.executor.replayed_steps == 0


@pytest.mark.parametrize("every", [0, 4])  # a full replay; a snapshot and the steps after it
async def test_a_world_session_keeps_its_context_across_an_update_of_another_models_weights(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts, tmp_path: Path, every: int) -> None:
    path = str(tmp_path / "lm-v1.pt")
    ref(seed=1).save_weights(path)
    a, _, s, twin = await pair(fleet, workers, "reference-world", "world_model_env", snapshot_every=every)
    await world_steps(s, twin, range(3))
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=path)
    await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1, timeout=30)
    await world_steps(s, twin, range(3, 6))
    c = await workers.add(ref(), **FAST, snapshot_every=every)  # joins with the new reference-lm weights
    await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1, timeout=30)
    await kill(workers, scripts, a)
    await world_steps(s, twin, range(6, 8))
    assert s.owner == c.id and c.worker.engine.policy_versions() == {"reference-lm": 1, "reference-world": 0}
    assert c.worker.executor.replayed_steps == (6 if every == 0 else 2)


def fault_free(model: str, steps: int) -> list[dict[str, Any]]:
    """The session's steps straight through one engine."""
    engine, out = ref(), []
    for i in range(steps):
        step = WorldStep.from_wire(world_step(i)) if model == "reference-world" else TokenStep.from_wire(turn(i))
        [res] = engine.run_direct(model, [EngineRequest("s", model, step, reset=i == 0)])
        assert not isinstance(res, BaseException)
        out.append(dict(res.output))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "video_latent" in b:
        return bool(a["video_latent"].tobytes() == b["video_latent"].tobytes())
    return bool(a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"])


@pytest.mark.slow
async def test_worker_processes_sigkill_then_snapshot_and_one_prefill_rebuilds_match_a_fault_free_run(
        redis_server: RedisServer, prefix: str, tmp_path: Path) -> None:
    procs = Fleet(redis_server.url, prefix)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]

    def worker(log: Path) -> None:
        with log.open("wb") as out:
            procs.procs.append(spawn_worker(
                redis_server.url, prefix, engine="reference", latent_shape=SHAPE, log_level="INFO",
                heartbeat_ms=procs.heartbeat_ms, lease_ms=procs.lease_ms, stderr=out, stdout=out,
                extra=("--snapshot-every", "8")))

    expected = {"reference-world": fault_free("reference-world", 40), "reference-lm": fault_free("reference-lm", 15)}
    try:
        worker(logs[0])
        await procs.wait_active(1)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            s = await fleet.create_session(model="reference-world", mode="world_model_env")
            t = await fleet.create_session(model="reference-lm", mode="tokens")
            worker(logs[1])
            await procs.wait_active(2)
            got: dict[str, list[StepResult]] = {"reference-world": [], "reference-lm": []}
            for i in range(37):
                got["reference-world"].append(await s.step(i, **world_step(i)))
                if i < 12:
                    got["reference-lm"].append(await t.step(i, **turn(i)))
            procs.procs[0].kill()  # SIGKILL; the other worker reaps it
            for i in range(37, 40):
                got["reference-world"].append(await asyncio.wait_for(s.step(i, **world_step(i)), 60))
            for i in range(12, 15):
                got["reference-lm"].append(await asyncio.wait_for(t.step(i, **turn(i)), 60))
    finally:
        procs.close()
    for model, results in got.items():
        assert all(r.ok and r.output is not None for r in results), [r.error for r in results if not r.ok]
        assert all(same(dict(r.output or {}), e) for r, e in zip(results, expected[model], strict=True)), model
    text = logs[1].read_text()
    assert f"rebuilt {s.session_id} (37 steps)" in text
    assert "with 5 engine requests after the snapshot of step 31" in text
    assert f"rebuilt {t.session_id} (12 steps)" in text and "with 1 engine requests" in text


async def test_the_reaper_wakes_at_the_next_lease_expiry(scripts: Scripts) -> None:
    lease_ms = 2000
    assert await until_next_expiry_s(scripts, lease_ms=lease_ms) is None  # no workers
    now = await redis_now_ms(scripts)
    await scripts.redis.zadd(scripts.keys.workers, {"w-dead": now - 5000})  # expired: any pass takes it
    assert await until_next_expiry_s(scripts, lease_ms=lease_ms) is None
    await scripts.redis.zadd(scripts.keys.workers, {"w-live": now, "w-quiet": now - 1500})
    until = await until_next_expiry_s(scripts, lease_ms=lease_ms)
    assert until is not None and 0.0 < until <= 0.5 + 0.001 + EXPIRY_MARGIN_S  # w-quiet's lease, not w-live's


async def test_one_prefill_leaves_the_reference_lm_cache_bit_for_bit_as_the_steps_did() -> None:
    engine = ref()
    steps = [TokenStep.from_wire(turn(i)) for i in range(8)]
    records: list[dict[str, Any]] = []
    for i, step in enumerate(steps):
        [out] = engine.run_direct("reference-lm", [EngineRequest("a", "reference-lm", step, reset=i == 0)])
        assert not isinstance(out, BaseException)
        records.append({"payload": encode(step.to_wire()), "generated": out.output["token_ids"],
                        "context_length": out.context_length})
    prefill = one_prefill("b", "reference-lm", records)
    assert prefill is not None and prefill.step.sampling.max_tokens == 0
    [out] = engine.run_direct("reference-lm", [prefill])
    assert not isinstance(out, BaseException) and out.context_length == records[-1]["context_length"]
    a, b = engine._lm_sessions["a"], engine._lm_sessions["b"]
    assert a.tokens == b.tokens
    assert all(torch.equal(x, y) for layer_a, layer_b in zip(a.cache, b.cache, strict=True)
               for x, y in zip(layer_a, layer_b, strict=True))
    nxt = TokenStep.from_wire(turn(8))
    outs = engine.run_direct("reference-lm", [EngineRequest("a", "reference-lm", nxt),
                                              EngineRequest("b", "reference-lm", nxt)])
    first, second = outs
    assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
    assert first.output["token_ids"] == second.output["token_ids"]
    assert first.output["logprobs"] == second.output["logprobs"]
    mm = TokenStep.from_wire({**turn(9), "multimodal": {"image": "x"}})
    assert one_prefill("c", "reference-lm", [*records, {**records[0], "payload": encode(mm.to_wire())}]) is None


async def test_a_snapshot_outlives_a_step_fallback_but_not_a_later_gen_or_an_uncommitted_step(
        fleet: FleetClient) -> None:
    sid = "s-snap@default"
    await fleet.redis.hset(fleet.keys.log(sid), LOG_SNAPSHOT_FIELD, pack(7, 2, b"state", b"out"))
    kept = await load_snapshot(fleet.redis, fleet.keys, sid, gen=3, committed=9)  # a fallback since: gen 3
    assert kept is not None and (kept.step, kept.gen, kept.state, kept.output) == (7, 2, b"state", b"out")
    assert await load_snapshot(fleet.redis, fleet.keys, sid, gen=1, committed=9) is None
    assert await load_snapshot(fleet.redis, fleet.keys, sid, gen=2, committed=6) is None
