"""A fork's branches inherit the parent's placement attributes (fork.lua): its priority, its
trainer (the branches count in that trainer's open sessions and a fork past its cap creates
nothing), its staleness bound and its trajectory's first_version, on real Redis with in-process
workers."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from broker import FleetClient
from broker.client.session import Session
from broker.redis.embedded import RedisServer
from broker.redis.layouts import SessionHash
from schemas.errors import ErrorCode, TrainerCapReachedError
from schemas.messages import StepResult
from tests.support import WorkerPool, run_cli, world_step
from tests.test_staleness import announce
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio
MODEL, MODE = "null-world", "world_model_env"
WAIT_S = 20.0  # every wait of these tests is bounded by this


async def record(fleet: FleetClient, session_id: str) -> SessionHash:
    return SessionHash.from_fields(await fleet.redis.hgetall(fleet.keys.session(session_id)))


async def open_count(fleet: FleetClient, trainer: str) -> int:
    return int(await fleet.redis.hget(fleet.keys.trainer_open, trainer) or 0)


async def trainers_cli(capsys: pytest.CaptureFixture[str], server: RedisServer, prefix: str,
                       *argv: str) -> tuple[int, str]:
    code, out, _ = await run_cli(capsys, "trainers", *argv, "--redis-url", server.url, "--prefix", prefix)
    return code, out


async def listed_open(capsys: pytest.CaptureFixture[str], server: RedisServer, prefix: str, trainer: str) -> int:
    """The open sessions `rollout-fleet trainers list` shows for ``trainer`` (0 when not listed)."""
    code, out = await trainers_cli(capsys, server, prefix, "list", "--json")
    assert code == 0, out
    rows = {r["trainer"]: r for r in map(json.loads, out.splitlines())}
    return int(rows[trainer]["open_sessions"]) if trainer in rows else 0


async def until_open(fleet: FleetClient, trainer: str, count: int) -> None:
    """Closes are answered before the worker gives the count back: wait for it (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while await open_count(fleet, trainer) != count:
        if time.monotonic() > deadline:
            pytest.fail(f"{trainer} did not reach {count} open sessions (has {await open_count(fleet, trainer)})")
        await asyncio.sleep(0.05)


def stale(result: StepResult) -> bool:
    return not result.ok and result.error is not None and result.error.code is ErrorCode.STALE_POLICY


async def stepped_parent(fleet: FleetClient, steps: int = 2, **create: object) -> Session:
    parent = await fleet.create_session(model=MODEL, mode=MODE, **create)  # type: ignore[arg-type]
    for i in range(steps):
        assert (await parent.step(i, **world_step(i))).ok
    return parent


@pytest.mark.parametrize("priority", ["interactive", "bulk"])
async def test_branches_carry_the_parents_priority_trainer_and_staleness_bound(
        fleet: FleetClient, workers: WorkerPool, priority: str) -> None:
    await workers.add(NullEngine(), capacity=8)
    parent = await stepped_parent(fleet, priority=priority, trainer="carol", max_staleness=3)
    mother = await record(fleet, parent.session_id)
    assert (mother.priority.value, mother.trainer, mother.max_staleness, mother.first_version) == (
        priority, "carol", 3, 0)
    for branch in await parent.fork(2):
        child = await record(fleet, branch.session_id)
        assert child.forked_from == parent.session_id
        assert (child.priority, child.trainer, child.max_staleness, child.first_version) == (
            mother.priority, mother.trainer, mother.max_staleness, mother.first_version)
        assert (await branch.step(2, **world_step(2))).ok  # and each steps on its own


async def test_branches_of_a_plain_session_stay_plain(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), capacity=8)
    parent = await stepped_parent(fleet)
    [branch] = await parent.fork(1)
    child = await record(fleet, branch.session_id)
    assert (child.priority.value, child.trainer) == ("bulk", fleet.trainer)
    fields = await fleet.redis.hgetall(fleet.keys.session(branch.session_id))
    assert b"max_staleness" not in fields and b"first_version" not in fields


async def test_branches_count_in_the_trainers_open_sessions_until_they_close(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    await workers.add(NullEngine(), capacity=8)
    async with FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice:
        parent = await stepped_parent(alice)
        assert await open_count(alice, "alice") == 1
        branches = await parent.fork(3)
        assert await open_count(alice, "alice") == 4
        assert await listed_open(capsys, redis_server, prefix, "alice") == 4
        for b in branches:
            await b.close()
        await until_open(alice, "alice", 1)
        assert await listed_open(capsys, redis_server, prefix, "alice") == 1
        await parent.close()
        await until_open(alice, "alice", 0)


async def test_a_fork_past_the_trainers_cap_is_refused_and_creates_nothing(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(NullEngine(), capacity=8)
    assert (await trainers_cli(capsys, redis_server, prefix, "set-cap", "alice", "3"))[0] == 0
    async with FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice:
        parent = await stepped_parent(alice)
        with pytest.raises(TrainerCapReachedError, match=r"trainer alice has 1 open sessions .* no room for 3") as no:
            await parent.fork(3)  # 1 + 3 > 3
        assert no.value.code is ErrorCode.TRAINER_CAP_REACHED
        # Nothing was created, counted or sent: the parent alone, and it still steps.
        assert await alice.redis.hlen(alice.keys.sessions) == 1
        assert await open_count(alice, "alice") == 1 and int(await alice.redis.hget(alice.keys.owned, w.id)) == 1
        kinds = [f[b"kind"] for _, f in await alice.redis.xrange(alice.keys.inbox(w.id))]
        assert b"fork" not in kinds
        assert (await parent.step(2, **world_step(2))).ok
        branches = await parent.fork(2)  # up to the cap exactly: allowed
        assert await open_count(alice, "alice") == 3 and len(branches) == 2


async def test_a_branch_of_a_session_with_max_staleness_0_answers_stale_policy_after_an_announce(
        fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), capacity=8)
    parent = await stepped_parent(fleet, steps=1, max_staleness=0)
    branches = await parent.fork(2)
    assert (await branches[0].step(1, **world_step(1))).ok  # on version 0, like its parent
    await announce(fleet, MODEL, 1)
    assert stale(await parent.step(1, **world_step(1)))
    for b, step_id in zip(branches, (2, 1), strict=True):
        refused = await b.step(step_id, **world_step(step_id))
        assert stale(refused), refused
        assert refused.error is not None and "max_staleness 0" in refused.error.message
    assert [(await b.status()).committed_step_id for b in branches] == [1, 0]
