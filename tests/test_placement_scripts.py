"""Placement in the Lua scripts: capacity per worker (with a per-model split), load signals, and the
owned counts failover, close and retire keep right."""

from __future__ import annotations

import pytest

from broker.ops.failover import fail_over, placement_candidates
from broker.redis.layouts import SessionHash
from broker.redis.script_replies import Applied, Created, FailedOver, Forked, Queued, Refused, Retry
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode

pytestmark = pytest.mark.asyncio
WORLD, LM = ("world_model_env", "w"), ("tokens", "t")


async def _register(scripts: Scripts, wid: str, capacity: int, *, caps: dict[tuple[str, str], int] | None = None,
                    pressure: float = 0.0) -> None:
    k = scripts.keys
    await scripts.register(wid, capacity=capacity, pools=[k.pool(*WORLD), k.pool(*LM)], ttl_ms=15000,
                           fields={"state": "active"},
                           pool_caps={k.pool(*pool): cap for pool, cap in (caps or {}).items()})
    beat = await scripts.heartbeat(wid, ttl_ms=15000, fields={}, pressure=pressure)
    assert beat.registered


async def _create(scripts: Scripts, sid: str, pool: tuple[str, str]) -> Created | Refused:
    reply = await scripts.create(sid, *pool, lease_ms=5000, retention="full", result_window=1)
    assert isinstance(reply, Created | Refused)
    return reply


async def _owned(scripts: Scripts, wid: str) -> int | None:
    raw = await scripts.redis.hget(scripts.keys.owned, wid)
    return None if raw is None else int(raw)


async def test_capacity_counts_every_pool_of_a_worker(scripts: Scripts) -> None:
    await _register(scripts, "a", capacity=2)
    assert await _create(scripts, "s1", WORLD) == Created("a")
    assert await _create(scripts, "s2", LM) == Created("a")
    for sid, pool in (("s3", WORLD), ("s4", LM)):  # two models, one capacity of 2: full
        full = await _create(scripts, sid, pool)
        assert isinstance(full, Refused) and full.code is ErrorCode.CAPACITY_EXHAUSTED
    assert await _owned(scripts, "a") == 2
    assert not await scripts.redis.exists(scripts.keys.session("s3"))  # a refusal writes nothing


async def test_a_per_model_split_caps_that_model_only(scripts: Scripts) -> None:
    await _register(scripts, "a", capacity=3, caps={WORLD: 1})
    assert await _create(scripts, "s1", WORLD) == Created("a")
    refused = await _create(scripts, "s2", WORLD)
    assert isinstance(refused, Refused) and refused.code is ErrorCode.CAPACITY_EXHAUSTED
    assert await _create(scripts, "s3", LM) == Created("a")
    assert await _create(scripts, "s4", LM) == Created("a")
    full = await _create(scripts, "s5", LM)  # the worker's own capacity still bounds the rest
    assert isinstance(full, Refused) and full.code is ErrorCode.CAPACITY_EXHAUSTED


async def test_placement_takes_the_lowest_share_plus_pressure(scripts: Scripts) -> None:
    await _register(scripts, "small", capacity=2)
    await _register(scripts, "big", capacity=8)
    assert await _create(scripts, "s1", WORLD) == Created("big")  # both empty: the pool's order (by name)
    assert await _create(scripts, "s2", LM) == Created("small")  # 0 < 1/8
    assert await _create(scripts, "s3", WORLD) == Created("big")  # 1/8 < 1/2 (small's share over both pools)
    assert await _create(scripts, "s4", LM) == Created("big")  # 2/8 < 1/2
    await scripts.heartbeat("big", ttl_ms=15000, fields={}, pressure=0.9)  # every step busy on big
    assert await _create(scripts, "s5", WORLD) == Created("small")  # 1/2 + 0 < 3/8 + 0.9


async def test_the_failover_candidates_rank_as_create_does(scripts: Scripts) -> None:
    for wid, cap, pressure in (("a", 4, 0.5), ("b", 4, 0.0), ("c", 2, 0.0), ("d", 8, 0.3)):
        await _register(scripts, wid, capacity=cap, pressure=pressure)
    for i in range(6):
        ranked = await placement_candidates(scripts, *WORLD, exclude="", lease_ms=5000)
        reply = await _create(scripts, f"s{i}", WORLD)
        assert isinstance(reply, Created) and reply.owner == ranked[0].worker_id


async def test_failover_honours_capacity_per_worker_and_moves_the_owned_counts(scripts: Scripts) -> None:
    await _register(scripts, "old", capacity=4)
    assert await _create(scripts, "s1", WORLD) == Created("old")
    await _register(scripts, "new", capacity=1)
    assert await _create(scripts, "s2", LM) == Created("new")  # new is now full over its other pool
    k = scripts.keys
    refused = await scripts.failover(session_id="s1", mode=WORLD[0], model=WORLD[1], old="old", new="new",
                                     lease_ms=5000, reason="handover")
    assert isinstance(refused, Retry)
    assert await scripts.redis.hget(k.session("s1"), "owner") == b"old"
    await scripts.redis.hset(k.capacity, "new", 2)
    moved = await scripts.failover(session_id="s1", mode=WORLD[0], model=WORLD[1], old="old", new="new",
                                   lease_ms=5000, reason="rebalance")
    assert isinstance(moved, FailedOver) and moved.epoch == 2
    assert (await _owned(scripts, "old"), await _owned(scripts, "new")) == (0, 2)


async def test_close_frees_a_place_of_the_worker(scripts: Scripts) -> None:
    await _register(scripts, "a", capacity=1)
    assert await _create(scripts, "s1", WORLD) == Created("a")
    closing = await scripts.control("s1", "a", kind="close", job_id="j", reply_to="c")
    assert isinstance(closing, Queued)
    applied = await scripts.apply_control(
        session_id="s1", worker_id="a", epoch=1, entry_id=closing.entry_id, job_id="j", kind="close",
        mode=WORLD[0], model=WORLD[1], reply_to="c", grace_ms=1000, reply_ttl_ms=1000)
    assert applied == Applied(-1)
    assert await _owned(scripts, "a") == 0
    assert await _create(scripts, "s2", LM) == Created("a")


async def test_a_stuck_session_is_marked_unplaced_until_it_moves(scripts: Scripts) -> None:
    k = scripts.keys
    await _register(scripts, "dead", capacity=2)
    assert await _create(scripts, "s1", WORLD) == Created("dead")
    await _register(scripts, "full", capacity=1)
    assert await _create(scripts, "s2", LM) == Created("full")
    await scripts.redis.zadd(k.workers, {"dead": 0})  # its lease ran out long ago; the live one is full
    report = await fail_over(scripts, "dead", lease_ms=5000)
    assert report.stuck == report.full == ["s1"] and not report.retired
    assert await scripts.redis.hget(k.session("s1"), "unplaced_ms") is not None
    assert not await scripts.mark_unplaced("s1", owner="someone-else")  # only the owner's sessions
    await _register(scripts, "fresh", capacity=2)
    report = await fail_over(scripts, "dead", lease_ms=5000)
    assert report.moved == {"s1": "fresh"} and report.retired
    assert await scripts.redis.hget(k.session("s1"), "unplaced_ms") is None
    # retiring took the dead worker's counts, load and split with it
    for key in (k.owned, k.pressure, k.capacity):
        assert await scripts.redis.hget(key, "dead") is None
    assert await _owned(scripts, "fresh") == 1


async def test_retire_drops_the_split_fields(scripts: Scripts) -> None:
    k = scripts.keys
    await _register(scripts, "a", capacity=2, caps={LM: 1})
    field = k.capacity_split_field("a", k.pool(*LM))
    assert await scripts.redis.hget(k.capacity, field) == b"1"
    await scripts.retire("a", pools=[k.pool(*WORLD), k.pool(*LM)], lease_ms=5000, reason="drained")
    assert await scripts.redis.hget(k.capacity, field) is None


async def test_a_pool_of_more_workers_than_one_lookup_slice_places_on_the_least_loaded(scripts: Scripts) -> None:
    """A create reads its pool's heartbeats, capacities, splits, owned counts and pressures in
    slices of a thousand: a worker past the first slice is found, with its own split and pressure."""
    k = scripts.keys
    for i in range(1200):
        await scripts.register(f"w{i:04d}", capacity=4, pools=[k.pool(*LM)], ttl_ms=15000, fields={"state": "active"},
                               pool_caps={k.pool(*LM): 1} if i == 1150 else None)
    await scripts.redis.hset(k.pressure, mapping={f"w{i:04d}": "0.5" for i in range(1200) if i not in (1150, 1199)})
    assert await _create(scripts, "s1", LM) == Created("w1150")  # no pressure, and room
    assert await _create(scripts, "s2", LM) == Created("w1199")  # w1150's split of 1 is full
    assert await _owned(scripts, "w1150") == 1 and await _owned(scripts, "w1199") == 1


async def test_session_hashes_are_hashtables_and_read_as_before(scripts: Scripts) -> None:
    """A token step looks a session's fields up 27 times; a listpack would scan them for each.
    The encoding field is no session field: the hash reads as a session as it did."""
    await _register(scripts, "a", capacity=4)
    k = scripts.keys
    assert await _create(scripts, "s1", LM) == Created("a")
    assert await scripts.fork("s1", "a", mode=LM[0], model=LM[1], branches=["b1"]) == Forked(-1)
    for sid in ("s1", "b1"):
        assert await scripts.redis.object("encoding", k.session(sid)) == b"hashtable", sid
        hashed = SessionHash.from_fields(await scripts.redis.hgetall(k.session(sid)))
        assert (hashed.owner, hashed.committed_step_id, hashed.next_step_id) == ("a", -1, 0)
    assert (SessionHash.from_fields(await scripts.redis.hgetall(k.session("b1")))).forked_from == "s1"


async def test_the_cell_wide_worker_hashes_are_hashtables_from_their_first_worker(scripts: Scripts) -> None:
    """Redis would keep them as listpacks up to 512 fields, scanned by every lookup."""
    await _register(scripts, "a", capacity=2)
    k = scripts.keys
    for key in (k.capacity, k.owned, k.pressure):
        assert await scripts.redis.object("encoding", key) == b"hashtable", key
    assert await scripts.redis.hget(k.capacity, "a") == b"2" and await _owned(scripts, "a") == 0
