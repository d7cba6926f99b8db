"""The worker's heartbeat (workers/heartbeat.py), its reaping looks (workers/reaper.py) and its idle
sweep (workers/idle.py): one command a beat between full heartbeats, without losing what the full
one did every beat."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from broker import FleetClient
from broker.redis.scripts import Scripts
from tests.support import FAST, WorkerPool, world_step
from workers.engines.null import NullEngine
from workers.heartbeat import FULL_BEATS, Heartbeats, idle_heartbeat_ms
from workers.idle import IdleSweeper
from workers.reaper import reap_loop

pytestmark = pytest.mark.asyncio
FIELDS = {"state": "active", "load": "0"}


async def _registered(scripts: Scripts, wid: str, beats: Heartbeats) -> None:
    now = await scripts.register(wid, capacity=4, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=beats.ttl_ms,
                                 fields=FIELDS)
    beats.registered(now, FIELDS)


async def test_beats_between_full_heartbeats_move_the_score_and_write_nothing_else(scripts: Scripts) -> None:
    beats = Heartbeats(scripts, heartbeat_ms=1000, lease_ms=5000)
    await _registered(scripts, "w1", beats)
    assert await beats.beat("w1", FIELDS, 0.0)  # the first beat after a registration is a full one
    assert beats.full_beats == 1 and beats.owned == 0 and beats.workers == 1
    await scripts.redis.hset(scripts.keys.worker("w1"), "load", "stale")  # a cheap beat leaves the hash alone
    scores = [await scripts.redis.zscore(scripts.keys.workers, "w1")]
    for _ in range(FULL_BEATS - 1):
        assert await beats.beat("w1", FIELDS, 0.0)
        scores.append(await scripts.redis.zscore(scripts.keys.workers, "w1"))
    assert beats.full_beats == 1
    assert scores == sorted(set(scores))  # every beat moved the score forward
    assert await scripts.redis.hget(scripts.keys.worker("w1"), "load") == b"stale"
    assert await beats.beat("w1", FIELDS, 0.0)  # the tenth: full again
    assert beats.full_beats == 2


async def test_a_change_is_written_at_the_next_beat_and_only_the_change(scripts: Scripts) -> None:
    beats = Heartbeats(scripts, heartbeat_ms=1000, lease_ms=5000)
    await _registered(scripts, "w1", beats)
    assert await beats.beat("w1", FIELDS, 0.0)
    await scripts.redis.hset(scripts.keys.worker("w1"), "state", "edited")
    assert await beats.beat("w1", {**FIELDS, "load": "3"}, 0.5)
    assert beats.full_beats == 2
    worker = await scripts.redis.hgetall(scripts.keys.worker("w1"))
    assert worker[b"load"] == b"3" and worker[b"state"] == b"edited"  # unchanged fields are not sent
    assert await scripts.redis.hget(scripts.keys.pressure, "w1") == b"0.5000"


async def test_an_expired_worker_hash_is_written_whole_again(scripts: Scripts) -> None:
    beats = Heartbeats(scripts, heartbeat_ms=1000, lease_ms=5000)
    await _registered(scripts, "w1", beats)
    assert await beats.beat("w1", FIELDS, 0.0)
    await scripts.redis.delete(scripts.keys.worker("w1"))
    for _ in range(FULL_BEATS + 1):  # the next full one finds it gone; the one after writes every field
        assert await beats.beat("w1", FIELDS, 0.0)
    assert await scripts.redis.hgetall(scripts.keys.worker("w1")) == {
        b"heartbeat_ms": await scripts.redis.hget(scripts.keys.worker("w1"), "heartbeat_ms"),
        b"state": b"active", b"load": b"0"}
    assert await scripts.redis.pttl(scripts.keys.worker("w1")) > 0


async def test_a_cheap_beat_notices_a_worker_the_reaper_retired(scripts: Scripts) -> None:
    beats = Heartbeats(scripts, heartbeat_ms=1000, lease_ms=5000)
    await _registered(scripts, "w1", beats)
    assert await beats.beat("w1", FIELDS, 0.0)
    await scripts.redis.zrem(scripts.keys.workers, "w1")
    assert not await beats.beat("w1", FIELDS, 0.0)
    assert await scripts.redis.zscore(scripts.keys.workers, "w1") is None  # XX: never added back


async def test_a_worker_removed_from_the_registry_comes_back_as_a_new_incarnation(
        fleet: FleetClient, workers: WorkerPool) -> None:
    w = await workers.add(NullEngine(), **FAST)
    old = w.id
    await fleet.redis.zrem(fleet.keys.workers, old)
    for _ in range(200):
        if w.id != old and await fleet.redis.zscore(fleet.keys.workers, w.id) is not None:
            break
        await asyncio.sleep(0.05)
    assert w.id != old and await fleet.redis.zscore(fleet.keys.workers, old) is None
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.status()).owner == w.id
    assert (await s.step(0, **world_step(0))).ok  # its reader reads the new incarnation's inbox


async def test_the_reaper_moves_a_dead_workers_sessions(fleet: FleetClient, workers: WorkerPool) -> None:
    dead = await workers.add(NullEngine(), reap=False, **FAST)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    await workers.kill(dead)
    live = await workers.add(NullEngine(), reap=False, **FAST)
    scripts = live.worker._scripts
    assert scripts is not None
    task = asyncio.create_task(reap_loop(scripts, lease_ms=FAST["lease_ms"], heartbeat_ms=FAST["heartbeat_ms"],
                                         clock=live.worker._beats.clock if live.worker._beats else None,
                                         workers=lambda: 2))
    try:
        for _ in range(200):
            if (await s.status()).owner == live.id:
                break
            await asyncio.sleep(0.05)
        assert (await s.status()).owner == live.id
        assert (await s.step(1, **world_step(1))).ok
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_idle_sweep_scans_only_when_the_count_says_so(scripts: Scripts) -> None:
    for wid in ("w1", "w2"):
        await scripts.register(wid, capacity=4, pools=[scripts.keys.pool("tokens", "m")], ttl_ms=15000,
                               fields=FIELDS)
    count = {"owned": 0, "stamp": 0}
    sweeper = IdleSweeper(scripts, lambda: "w1", interval_s=1.0, owned=lambda: (count["owned"], count["stamp"]))
    assert await sweeper.sweep() == 0 and sweeper.scans == 0  # it owns nothing: no scan
    await scripts.create("s1", "tokens", "m", lease_ms=5000, retention="full", result_window=1, idle_timeout_ms=1)
    owner = await scripts.redis.hget(scripts.keys.sessions, "s1")
    await asyncio.sleep(0.02)  # past its 1 ms idle timeout (a sweep within that ms would keep it)
    count["owned"], count["stamp"] = 1, 1
    sweeper = IdleSweeper(scripts, lambda: owner.decode(), interval_s=1.0,
                          owned=lambda: (count["owned"], count["stamp"]))
    await sweeper.sweep()
    await sweeper.sweep()  # the same count again: no second scan
    assert sweeper.scans == 1 and sweeper.closed == 1  # never stepped, and closed all the same
    assert await scripts.redis.hget(scripts.keys.session("s1"), "closed") == b"1"


async def test_the_idle_pace_is_twice_the_heartbeat_within_two_fifths_of_the_lease() -> None:
    assert idle_heartbeat_ms(1000, 5000) == 2000  # the defaults
    assert idle_heartbeat_ms(1000, 4000) == 1600  # bounded by the lease
    assert idle_heartbeat_ms(2000, 3000) == 2000  # never below the heartbeat
    assert idle_heartbeat_ms(5000, 30000) == 10000


async def test_a_worker_with_no_session_beats_at_the_idle_pace_until_it_serves_one(
        fleet: FleetClient, workers: WorkerPool) -> None:
    w = await workers.add(NullEngine(), heartbeat_ms=100, lease_ms=1000)
    beats = w.worker._beats
    assert beats is not None and beats.idle_ms == 200
    assert beats.interval_s(serving=False) == 0.2 and beats.interval_s(serving=True) == 0.1

    async def beats_in(seconds: float) -> int:
        before = await fleet.redis.zscore(fleet.keys.workers, w.id)
        changes, last = 0, before
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            score = await fleet.redis.zscore(fleet.keys.workers, w.id)
            changes += score != last
            last = score
            await asyncio.sleep(0.01)
        return changes

    idle = await beats_in(2.0)  # ~10 beats at 200 ms
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).ok  # it serves a session now
    busy = await beats_in(2.0)  # ~20 beats at 100 ms
    assert 6 <= idle <= 13 and busy >= 15, (idle, busy)
    assert (await s.step(1, **world_step(1))).ok
