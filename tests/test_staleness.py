"""Staleness and admission (docs/async_rl.md): a session with ``max_staleness`` answers
``stale_policy`` once the announced version passed its trajectory's first version by more than
the bound, at enqueue and for steps queued before the announcement, and steps again after a reset;
a producer's admission bound refuses or waits, shared by every client that names it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from broker import FleetClient, SyncFleetClient
from broker.client import Admission
from broker.client.admission_wait import admission_state
from broker.ops.weights import CONTROL_MAXLEN, WeightUpdate, update_weights, workers_at_version
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from broker.redis.layouts import SessionHash
from broker.redis.scripts import lua_source
from broker.rollouts.multiturn import MultiTurnConfig, RolloutStatus, run_multiturn
from schemas.errors import AdmissionClosedError, CapacityExhaustedError, ErrorCode, InvalidRequestError
from schemas.messages import StepResult
from tests.procs import Fleet
from tests.support import WorkerPool, world_step
from tests.test_multiturn import QUESTION, MathEnv, ScriptedLM
from tests.test_weights import SHAPE, TOKENS, engine
from workers.engines.null import NullEngine

pytestmark = pytest.mark.asyncio


async def announce(fleet: FleetClient, model: str, version: int, path: str = "-") -> None:
    """Announce ``version`` of ``model`` and wait until its workers run it."""
    await update_weights(fleet.redis, fleet.keys, model=model, version=version, path=path)
    await workers_at_version(fleet.redis, fleet.keys, model=model, version=version, timeout=60)


async def session_hash(fleet: FleetClient, session_id: str) -> SessionHash:
    return SessionHash.from_fields(await fleet.redis.hgetall(fleet.keys.session(session_id)))


def stale(result: StepResult) -> bool:
    return not result.ok and result.error is not None and result.error.code is ErrorCode.STALE_POLICY


async def test_worker_process_bounds_staleness_and_a_reset_starts_a_new_trajectory(
        redis_server: RedisServer, prefix: str, tmp_path: Path) -> None:
    """max_staleness=1 on a reference worker process: steps at v and v+1 run, v+2 answers
    stale_policy (at enqueue, the commit stays), a reset clears it and the session steps again."""
    paths = {v: str(tmp_path / f"v{v}.pt") for v in (1, 2)}
    for v, path in paths.items():
        engine(seed=v).save_weights(path)
    procs = Fleet(redis_server.url, prefix)
    try:
        procs.worker("--latent-shape", ",".join(map(str, SHAPE)), engine="reference")
        await procs.wait_active(1)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            s = await fleet.create_session("reference-lm", "tokens", max_staleness=1)
            plain = await fleet.create_session("reference-lm", "tokens")
            first = await s.step(0, **TOKENS)
            assert first.ok and first.policy_version == 0
            assert (await session_hash(fleet, s.session_id)).first_version == 0
            await announce(fleet, "reference-lm", 1, paths[1])
            second = await s.step(1, **TOKENS)
            assert second.ok and second.policy_version == 1
            await announce(fleet, "reference-lm", 2, paths[2])
            refused = await s.step(2, **TOKENS)
            assert stale(refused) and refused.error is not None and "max_staleness 1" in refused.error.message
            st = await s.status()
            assert (st.committed_step_id, st.next_step_id) == (1, 2)  # the commit never moved
            assert stale(await s.step(2, **TOKENS))  # a retry gets the same answer
            assert stale(await s.step(3, **TOKENS))  # and so does any later step of the trajectory
            assert (await s.step(1, **TOKENS)).duplicate  # a committed step still answers its stored result
            assert await s.reset() == -1
            assert (await session_hash(fleet, s.session_id)).first_version is None
            again = await s.step(0, **TOKENS)
            assert again.ok and again.policy_version == 2
            assert (await session_hash(fleet, s.session_id)).first_version == 2
            # No bound: the same history steps on as before.
            assert all([(await plain.step(i, **TOKENS)).ok for i in range(3)])
            assert (await session_hash(fleet, plain.session_id)).max_staleness is None
    finally:
        procs.close()


async def test_steps_queued_before_the_announcement_answer_stale_policy(
        fleet: FleetClient, workers: WorkerPool) -> None:
    """max_staleness=0: step 1 waits at the weight gate for version 1 and step 2 behind it in the
    lane; the update makes both stale when they reach the engine (the gate's check and the lane's)."""
    await workers.add(NullEngine())
    s = await fleet.create_session("null-world", "world_model_env", max_staleness=0)
    assert (await s.step(0, **world_step(0))).ok
    held = s.submit(1, min_policy_version=1, **world_step(1))
    behind = s.submit(2, **world_step(2))
    for _ in range(200):  # both enqueued (bounded wait)
        if (await s.status()).next_step_id == 3:
            break
        await asyncio.sleep(0.02)
    assert (await s.status()).next_step_id == 3
    await announce(fleet, "null-world", 1)
    results = await asyncio.wait_for(asyncio.gather(held, behind), 30)
    assert all(stale(r) for r in results), results
    assert (await s.status()).committed_step_id == 0
    await s.reset()
    fresh = await s.step(0, **world_step(0))
    assert fresh.ok and fresh.policy_version == 1
    assert (await s.step(1, **world_step(1))).ok


async def test_without_max_staleness_nothing_changes(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    s = await fleet.create_session("null-world", "world_model_env")
    assert (await s.step(0, **world_step(0))).ok
    await announce(fleet, "null-world", 5)
    assert (await s.step(1, **world_step(1))).ok
    fields = await fleet.redis.hgetall(fleet.keys.session(s.session_id))
    assert b"max_staleness" not in fields and b"first_version" not in fields


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", 10**10])
async def test_a_bad_max_staleness_creates_nothing(fleet: FleetClient, workers: WorkerPool, bad: Any) -> None:
    await workers.add(NullEngine())
    with pytest.raises(InvalidRequestError, match="max_staleness"):
        await fleet.create_session("null-world", "world_model_env", max_staleness=bad)
    assert await fleet.redis.hlen(fleet.keys.sessions) == 0


@pytest.mark.parametrize("kwargs", [
    {"name": "a:b", "batch_size": 1}, {"name": "a", "batch_size": 0}, {"name": "a", "batch_size": 1.0},
    {"name": "a", "batch_size": 1, "max_offpolicyness": -1},
    {"name": "a", "batch_size": 1, "wait_s": float("nan")}, {"name": "a", "batch_size": 1, "wait_s": -1},
])
async def test_a_bad_admission_is_refused_before_anything_is_sent(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match="admission"):
        Admission(**kwargs)


async def test_admission_needs_a_client_of_one_cell(redis_server: RedisServer, prefix: str,
                                                    workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    async with FleetClient(redis_server.url, prefix=prefix, cell="*") as every:
        with pytest.raises(InvalidRequestError, match="one cell"):
            await every.create_session("null-world", "world_model_env", admission=Admission("p", 1))
    async with FleetClient(redis_server.url, prefix=prefix) as fleet:
        assert await fleet.redis.hlen(fleet.keys.sessions) == 0


async def test_admission_refuses_over_the_bound_until_a_version_is_announced(
        fleet: FleetClient, workers: WorkerPool) -> None:
    """batch 2, max_offpolicyness 1: (0 + 1 + 1) x 2 = 4 trajectories at version 0, 6 at version 1."""
    await workers.add(NullEngine())
    gate = Admission("producer", batch_size=2, max_offpolicyness=1)
    for _ in range(4):
        await fleet.create_session("null-world", "world_model_env", admission=gate)
    with pytest.raises(AdmissionClosedError, match=r"admission producer .* is closed") as refused:
        await fleet.create_session("null-world", "world_model_env", admission=gate)
    assert refused.value.code is ErrorCode.ADMISSION_CLOSED
    assert await fleet.redis.hlen(fleet.keys.sessions) == 4
    state = await admission_state(fleet.redis, fleet.keys, gate, "null-world")
    assert (state.admitted, state.version, state.bound, state.open) == (4, 0, 4, False)
    other = await fleet.create_session("null-world", "world_model_env")  # outside the bound: unaffected
    assert other.session_id
    await announce(fleet, "null-world", 1)
    for _ in range(2):
        await fleet.create_session("null-world", "world_model_env", admission=gate)
    with pytest.raises(AdmissionClosedError):
        await fleet.create_session("null-world", "world_model_env", admission=gate)


async def test_a_create_refused_for_capacity_counts_nothing(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine(), capacity=1)
    gate = Admission("full", batch_size=5)
    await fleet.create_session("null-world", "world_model_env", admission=gate)
    with pytest.raises(CapacityExhaustedError):
        await fleet.create_session("null-world", "world_model_env", admission=gate)
    assert (await admission_state(fleet.redis, fleet.keys, gate, "null-world")).admitted == 1


async def test_a_waiting_create_is_admitted_after_an_announcement(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    gate = Admission("waiter", batch_size=1, wait_s=60)
    await fleet.create_session("null-world", "world_model_env", admission=gate)
    waiting = asyncio.create_task(fleet.create_session("null-world", "world_model_env", admission=gate))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # over the bound: it waits for a version
    await update_weights(fleet.redis, fleet.keys, model="null-world", version=1, path="-")
    s = await asyncio.wait_for(waiting, 30)
    assert (await s.step(0, **world_step(0))).ok
    short = Admission("waiter", batch_size=1, wait_s=0.2)
    with pytest.raises(AdmissionClosedError, match=r"waited 0.2s"):
        await fleet.create_session("null-world", "world_model_env", admission=short)


async def test_two_clients_share_one_bound(redis_server: RedisServer, prefix: str, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    gate = Admission("shared", batch_size=3)
    async with FleetClient(redis_server.url, prefix=prefix) as a, FleetClient(redis_server.url, prefix=prefix) as b:
        for client in (a, b, a):
            await client.create_session("null-world", "world_model_env", admission=gate)
        for client in (a, b):
            with pytest.raises(AdmissionClosedError):
                await client.create_session("null-world", "world_model_env", admission=gate)
        # Another producer's name has its own count.
        await b.create_session("null-world", "world_model_env", admission=Admission("other", batch_size=1))


async def test_the_sync_client_takes_both_options(redis_server: RedisServer, prefix: str,
                                                  workers: WorkerPool) -> None:
    await workers.add(NullEngine())

    def trainer() -> tuple[int | None, bool]:
        with SyncFleetClient(redis_server.url, prefix=prefix) as fleet:
            gate = Admission("sync", batch_size=1)
            s = fleet.create_session("null-world", "world_model_env", max_staleness=2, admission=gate)
            assert s.step(0, **world_step(0)).ok
            try:
                fleet.create_session("null-world", "world_model_env", admission=gate)
            except AdmissionClosedError:
                return s.status().committed_step_id, True
            return None, False

    assert await asyncio.to_thread(trainer) == (0, True)


async def test_the_announced_version_only_goes_up(fleet: FleetClient) -> None:
    for version in (3, 2, 3):
        await update_weights(fleet.redis, fleet.keys, model="m", version=version, path="-")
    assert await fleet.redis.hget(fleet.keys.announced, "m") == b"3"
    assert await fleet.redis.xlen(fleet.keys.control) == 3  # every announcement reaches the workers


class AnnouncingEnv(MathEnv):
    """Announces a new version of the policy while the trainer scores a turn (as an async trainer
    publishing weights meanwhile would): the announcement goes through the real announce.lua."""

    def __init__(self, url: str, keys: CellKeys) -> None:
        super().__init__()
        self.redis, self.keys = redis.Redis.from_url(url), keys

    def step(self, response: str) -> tuple[str, bool, dict[str, Any]]:
        fields = WeightUpdate("scripted-lm", 1, "-").fields()
        self.redis.eval(lua_source("announce"), 2, self.keys.control, self.keys.announced, "scripted-lm", 1,
                        CONTROL_MAXLEN, *[item for pair in fields.items() for item in pair])
        return super().step(response)

    def close(self) -> None:
        super().close()
        self.redis.close()


async def test_the_multiturn_driver_aborts_a_sample_past_its_staleness(
        redis_server: RedisServer, fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(ScriptedLM(["I think 5<|eos|>", "It is 4<|eos|>"]))
    env = AnnouncingEnv(redis_server.url, fleet.keys)
    sample = await run_multiturn(fleet, env, QUESTION, MultiTurnConfig(model="scripted-lm", max_staleness=0))
    assert sample.status is RolloutStatus.ABORTED and sample.turns == 2
    assert sample.metadata["error"]["code"] == "stale_policy"
    assert sample.weight_versions == [0] * sum(sample.loss_mask)  # the first turn's tokens, all on version 0
    assert env.closes == 1 and (await fleet.status(sample.session_id)).closed
