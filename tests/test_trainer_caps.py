"""Per-trainer caps on open sessions: create.lua refuses a trainer at its cap (atomically, with
``trainer_cap_reached``), other trainers are not touched, and the count stays right through a
close, an idle close and the loss of a worker (its sessions move but stay open)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.errors import ErrorCode, InvalidRequestError, TrainerCapReachedError
from tests.procs import Fleet
from tests.support import FAST, WorkerPool, reap_until_moved, run_cli, world_step
from workers.engines.null import NullEngine

MODEL, MODE = "null-world", "world_model_env"
WAIT_S = 20.0


async def cli(capsys: pytest.CaptureFixture[str], server: RedisServer, prefix: str,
              *argv: str) -> tuple[int, str, str]:
    return await run_cli(capsys, "trainers", *argv, "--redis-url", server.url, "--prefix", prefix)


async def open_count(fleet: FleetClient, trainer: str) -> int:
    return int(await fleet.redis.hget(fleet.keys.trainer_open, trainer) or 0)


async def until_count(fleet: FleetClient, trainer: str, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while await open_count(fleet, trainer) != count:
        if time.monotonic() > deadline:
            pytest.fail(f"{trainer} did not reach {count} open sessions (has {await open_count(fleet, trainer)})")
        await asyncio.sleep(0.05)


async def test_a_trainer_at_its_cap_is_refused_and_other_trainers_are_not(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    w = await workers.add(NullEngine(), capacity=20)
    assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "2"))[0] == 0
    async with (FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice,
                FleetClient(redis_server.url, prefix=prefix, trainer="bob") as bob):
        first = [await alice.create_session(model=MODEL, mode=MODE) for _ in range(2)]
        with pytest.raises(TrainerCapReachedError, match="trainer alice has 2 open sessions in this cell, its cap is"):
            await alice.create_session(model=MODEL, mode=MODE)
        # Refused before placement: nothing was created or counted.
        assert await alice.redis.hlen(alice.keys.sessions) == 2 and await open_count(alice, "alice") == 2
        assert int(await alice.redis.hget(alice.keys.owned, w.id)) == 2
        for _ in range(3):  # bob has no cap
            await bob.create_session(model=MODEL, mode=MODE)
        # The default cap binds every trainer without its own; alice keeps hers.
        assert (await cli(capsys, redis_server, prefix, "set-default-cap", "3"))[0] == 0
        with pytest.raises(TrainerCapReachedError) as refused:
            await bob.create_session(model=MODEL, mode=MODE)
        assert refused.value.code is ErrorCode.TRAINER_CAP_REACHED
        # A trainer named per session counts there, not in the client's own trainer.
        carol = await bob.create_session(model=MODEL, mode=MODE, trainer="carol")
        assert await open_count(bob, "carol") == 1 and await open_count(bob, "bob") == 3
        assert (await first[0].step(0, **world_step(0))).ok and (await carol.step(0, **world_step(0))).ok
        code, out, _ = await cli(capsys, redis_server, prefix, "list", "--json")
        rows = {r["trainer"]: r for r in map(json.loads, out.splitlines())}
        assert code == 0 and rows["alice"] == {"cell": "0", "trainer": "alice", "open_sessions": 2, "cap": 2,
                                               "own_cap": True}
        assert (rows["bob"]["open_sessions"], rows["bob"]["cap"], rows["bob"]["own_cap"]) == (3, 3, False)
        assert rows["*"]["cap"] == 3
        assert (await cli(capsys, redis_server, prefix, "remove-default-cap"))[0] == 0
        await bob.create_session(model=MODEL, mode=MODE)  # no cap again


async def test_creates_racing_for_the_last_places_get_exactly_the_cap(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    await workers.add(NullEngine(), capacity=50)
    assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "3"))[0] == 0
    async with FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice:
        outcomes = await asyncio.gather(*(alice.create_session(model=MODEL, mode=MODE) for _ in range(12)),
                                        return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(refused) == 9 and all(isinstance(o, TrainerCapReachedError) for o in refused)
        assert await open_count(alice, "alice") == 3 and await alice.redis.hlen(alice.keys.sessions) == 3


async def test_the_count_follows_close_idle_close_and_a_workers_loss(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    a = await workers.add(NullEngine(), capacity=10, idle_sweep_s=0.1, **FAST)
    assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "3"))[0] == 0
    async with FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice:
        closed = await alice.create_session(model=MODEL, mode=MODE)
        idle = await alice.create_session(model=MODEL, mode=MODE, idle_timeout_s=0.5)
        kept = await alice.create_session(model=MODEL, mode=MODE)
        with pytest.raises(TrainerCapReachedError):
            await alice.create_session(model=MODEL, mode=MODE)
        await closed.close()
        await until_count(alice, "alice", 2)  # once its owner applied the close, as for its capacity
        await closed.close()  # closing twice counts once
        assert (await kept.step(0, **world_step(0))).ok  # (the owner ran everything queued before)
        assert await open_count(alice, "alice") == 2
        extra = await alice.create_session(model=MODEL, mode=MODE)
        await until_count(alice, "alice", 2)  # the idle one was closed by its owner
        assert (await idle.status()).closed
        b = await workers.add(NullEngine(), capacity=10, **FAST)
        await workers.kill(a)
        await reap_until_moved(alice.scripts, a.id)
        # Moved, not closed: both still count, and the cap still binds.
        assert {(await s.status()).owner for s in (kept, extra)} == {b.id}
        assert await open_count(alice, "alice") == 2
        assert (await kept.step(1, **world_step(1))).ok
        await alice.create_session(model=MODEL, mode=MODE)
        with pytest.raises(TrainerCapReachedError):
            await alice.create_session(model=MODEL, mode=MODE)
        await extra.close()
        await until_count(alice, "alice", 2)


async def test_a_client_of_every_cell_goes_on_to_a_cell_where_its_trainer_has_room(
        redis_server: RedisServer, prefix: str, workers: WorkerPool, capsys: pytest.CaptureFixture[str]) -> None:
    for cell, capacity in (("a", 10), ("b", 5)):  # a has more room: every create tries it first
        await workers.add(NullEngine(), cell=cell, capacity=capacity)
    assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "1", "--cell", "*"))[0] == 0
    async with FleetClient(redis_server.url, prefix=prefix, cell="*", trainer="alice") as alice:
        placed = sorted([(await alice.create_session(model=MODEL, mode=MODE)).cell for _ in range(2)])
        assert placed == ["a", "b"]  # a refused the second (its cap there), b took it
        with pytest.raises(TrainerCapReachedError, match="in every one of the cells"):
            await alice.create_session(model=MODEL, mode=MODE)


@pytest.mark.parametrize("argv", [
    ("set-cap", "bad name", "3"), ("set-cap", "a*b", "3"), ("set-cap", "alice", "-1"), ("set-cap", "alice", "x"),
    ("set-cap", "alice", "99999999999"), ("set-cap", "alice"), ("set-default-cap",),
    ("set-default-cap", "alice", "3"), ("set-default-cap", "-3"), ("remove-cap",), ("remove-cap", "alice", "3"),
    ("remove-default-cap", "alice"), ("list", "alice"),
])
async def test_bad_cli_input_is_one_line_and_changes_nothing(
        redis_server: RedisServer, prefix: str, fleet: FleetClient, capsys: pytest.CaptureFixture[str],
        argv: tuple[str, ...]) -> None:
    assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "5"))[0] == 0
    code, _, err = await cli(capsys, redis_server, prefix, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"trainers {argv[0]}: ")
    assert await fleet.redis.hgetall(fleet.keys.trainer_caps) == {b"alice": b"5"}


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "a:b", "*", 3])
async def test_a_bad_trainer_name_is_refused_and_creates_nothing(
        redis_server: RedisServer, prefix: str, fleet: FleetClient, workers: WorkerPool, bad: object) -> None:
    await workers.add(NullEngine())
    with pytest.raises(InvalidRequestError, match="trainer must be"):
        await fleet.create_session(model=MODEL, mode=MODE, trainer=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="trainer must be"):
        FleetClient(redis_server.url, prefix=prefix, trainer=bad)  # type: ignore[arg-type]
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0 and not await fleet.redis.exists(fleet.keys.trainer_open)


def test_a_client_id_that_is_no_trainer_name_counts_as_the_default_trainer() -> None:
    assert FleetClient("redis://127.0.0.1:1/0", client_id="me@host:1").trainer == "default"
    assert FleetClient("redis://127.0.0.1:1/0", client_id="me-1").trainer == "me-1"


@pytest.mark.slow
async def test_worker_processes_a_sigkilled_owners_sessions_still_count(
        redis_server: RedisServer, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    procs = Fleet(redis_server.url, prefix)
    try:
        first = procs.worker()
        await procs.wait_active(1)
        assert (await cli(capsys, redis_server, prefix, "set-cap", "alice", "2"))[0] == 0
        async with FleetClient(redis_server.url, prefix=prefix, trainer="alice") as alice:
            sessions = [await alice.create_session(model=MODEL, mode=MODE) for _ in range(2)]
            assert all([(await s.step(0, **world_step(0))).ok for s in sessions])
            procs.worker()
            await procs.wait_active(2)
            first.kill()  # SIGKILL: the other worker takes its sessions over (no supervisor runs)
            results = await asyncio.wait_for(asyncio.gather(*(s.step(1, **world_step(1)) for s in sessions)), 60)
            assert all(r.ok for r in results), [r.error for r in results]
            assert await open_count(alice, "alice") == 2
            with pytest.raises(TrainerCapReachedError):
                await alice.create_session(model=MODEL, mode=MODE)
            await sessions[0].close()
            await until_count(alice, "alice", 1)
            await alice.create_session(model=MODEL, mode=MODE)
    finally:
        procs.close()
