"""Weight updates through the control stream: every result reports the version whose weights
produced it, no step runs half-updated, steps can require a minimum version."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from broker import FleetClient
from broker.ops.weights import update_weights, workers_at_version
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode, StepAborted
from schemas.messages import TokenStep, WorldStep
from tests.support import FAST, WorkerPool, reap_until_moved, world_step
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.null import NullEngine
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig
from workers.engines.reference_lm import ReferenceLMConfig
from workers.rebuild import teacher_forced
from workers.weight_control import WeightGate
from workers.worker import Worker

pytestmark = pytest.mark.asyncio
SHAPE = (1, 4, 2, 8, 10)
TOKENS = {"token_ids": [257, 260, 72, 105, 261], "sampling": {"max_tokens": 6, "seed": 5}}


def engine(seed: int = 0) -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, seed=seed))


def direct(seed: int) -> tuple[bytes, list[int]]:
    e = engine(seed)
    [w] = e.run_direct("reference-world", [EngineRequest("d", "reference-world", WorldStep.from_wire(world_step(0)),
                                                         stateless=True)])
    [t] = e.run_direct("reference-lm", [EngineRequest("d", "reference-lm", TokenStep.from_wire(TOKENS),
                                                      stateless=True)])
    assert not isinstance(w, BaseException) and not isinstance(t, BaseException)
    return w.output["video_latent"].tobytes(), list(t.output["token_ids"])


async def test_update_mid_run_every_result_reports_the_weights_that_produced_it(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path
) -> None:
    path = str(tmp_path / "v1.pt")
    engine(seed=1).save_weights(path)
    expected = {0: direct(0), 1: direct(1)}
    assert expected[0] != expected[1]
    await workers.add(engine())
    world = await fleet.create_session(model="reference-world", mode="world_model_env")
    lm = await fleet.create_session(model="reference-lm", mode="tokens")

    async def probe() -> list[tuple[int, bytes, list[int]]]:
        out = []
        for _ in range(12):
            w, t = await asyncio.gather(world.step(0, use_session_context=False, **world_step(0)),
                                        lm.step(0, use_session_context=False, **TOKENS))
            assert w.policy_version == t.policy_version or abs(w.policy_version - t.policy_version) == 1
            out.append((w.policy_version, w.output["video_latent"].tobytes(), []))
            out.append((t.policy_version, b"", list(t.output["token_ids"])))
        return out

    running = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    await update_weights(fleet.redis, fleet.keys, model="reference-world", version=1, path=path)
    results = await running
    await workers_at_version(fleet.redis, fleet.keys, model="reference-world", version=1)
    after = await world.step(0, use_session_context=False, **world_step(0))
    results.append((after.policy_version, after.output["video_latent"].tobytes(), []))
    for version, latent, tokens in results:  # exactly one version's output: never half-updated
        if latent:
            assert latent == expected[version][0]
        else:
            assert tokens == expected[version][1]
    assert after.policy_version == 1
    status = await fleet.redis.hget(fleet.keys.worker(workers.running[0].id), "policy_version")
    assert status == b"1"


async def test_a_step_can_require_a_minimum_policy_version(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path
) -> None:
    path = str(tmp_path / "v2.pt")
    engine(seed=2).save_weights(path)
    await workers.add(engine())
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    waiting = s.submit(0, min_policy_version=2, **world_step(0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # held until the worker has version 2
    await update_weights(fleet.redis, fleet.keys, model="reference-world", version=2, path=path)
    r = await asyncio.wait_for(waiting, 10)
    assert r.ok and r.policy_version == 2
    assert r.output["video_latent"].tobytes() == direct(2)[0]


async def test_a_worker_started_after_an_update_loads_the_latest_weights(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path
) -> None:
    for v in (1, 3):
        engine(seed=v).save_weights(str(tmp_path / f"v{v}.pt"))
        await update_weights(fleet.redis, fleet.keys, model="reference-world", version=v,
                             path=str(tmp_path / f"v{v}.pt"))
    await workers.add(engine())
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    r = await s.step(0, **world_step(0))
    assert r.policy_version == 3 and r.output["video_latent"].tobytes() == direct(3)[0]


async def test_a_bad_weights_file_keeps_the_old_version_and_says_why(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    w = await workers.add(engine())
    await update_weights(fleet.redis, fleet.keys, model="reference-world", version=1, path=str(bad))
    for _ in range(100):
        err = await fleet.redis.hget(fleet.keys.worker(w.id), "weights_error")
        if err:
            break
        await asyncio.sleep(0.05)
    assert err and b"version 1" in err
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    assert (await s.step(0, **world_step(0))).policy_version == 0


# --------------------------------------------------------------------------- aborting in-flight steps

LONG = {"token_ids": [257, 260, 72, 105, 261], "sampling": {"max_tokens": 1500, "seed": 7, "temperature": 0.8}}
NEXT = {"token_ids": [72, 105], "sampling": {"max_tokens": 5, "seed": 8}}


def long_engine(seed: int = 0) -> ReferenceEngine:
    """No end-of-sequence token, so a step generates exactly ``max_tokens`` (a long step to abort)."""
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, seed=seed, lm=ReferenceLMConfig(eos_token_id=-1)))


def direct_turns(seed: int) -> list[list[int]]:
    """The two turns of one session, run directly on an engine with ``seed``'s weights."""
    e = long_engine(seed)
    out = []
    for index, turn in enumerate((LONG, NEXT)):
        [r] = e.run_direct("reference-lm", [EngineRequest("d", "reference-lm", TokenStep.from_wire(turn),
                                                          reset=index == 0)])
        assert not isinstance(r, BaseException)
        out.append(list(r.output["token_ids"]))
    return out


async def inside_the_engine(worker: Worker) -> None:
    assert worker.weights is not None
    for _ in range(400):
        if worker.weights.gate.running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the step never reached the engine")


@pytest.mark.slow  # three 1,500-token CPU generations: the slow tier
@pytest.mark.parametrize("in_flight", ["abort", "finish"])
async def test_an_update_aborts_or_finishes_the_steps_in_flight(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path, in_flight: str
) -> None:
    path = str(tmp_path / "v1.pt")
    long_engine(seed=1).save_weights(path)
    expected = {0: direct_turns(0), 1: direct_turns(1)}
    assert expected[0][0] != expected[1][0]
    w = await workers.add(long_engine())
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    running = s.submit(0, **LONG)
    await inside_the_engine(w.worker)
    await asyncio.sleep(0.1)  # some tokens are generated on the old weights
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=path, in_flight=in_flight)
    first = await asyncio.wait_for(running, 60)
    second = await s.step(1, **NEXT)
    assert first.ok and second.ok, (first.error, second.error)
    assert second.policy_version == 1
    assert w.worker.executor is not None
    if in_flight == "abort":
        # Ran again, whole, on the new weights; the aborted run left no trace in the context.
        assert first.policy_version == 1 and w.worker.executor.aborted_steps == 1
        assert [first.output["token_ids"], second.output["token_ids"]] == expected[1]
    else:
        assert first.policy_version == 0 and w.worker.executor.aborted_steps == 0
        assert first.output["token_ids"] == expected[0][0]
    assert len(first.output["token_ids"]) == 1500 and first.committed_step_id == 0


@pytest.mark.slow
async def test_an_aborting_update_waits_for_engines_that_cannot_abort(
    fleet: FleetClient, workers: WorkerPool, tmp_path: Path
) -> None:
    """Engines without abort (e.g. a remote world-model step) let the running step finish."""

    class NoAbort(ReferenceEngine):
        async def abort_running(self) -> bool:
            return False

    path = str(tmp_path / "v1.pt")
    long_engine(seed=1).save_weights(path)
    w = await workers.add(NoAbort(long_engine().config))
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    running = s.submit(0, **LONG)
    await inside_the_engine(w.worker)
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=path, in_flight="abort")
    first = await asyncio.wait_for(running, 60)
    assert first.ok and first.policy_version == 0 and first.output["token_ids"] == direct_turns(0)[0]
    await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1)


async def test_update_weights_rejects_an_unknown_in_flight_policy(fleet: FleetClient) -> None:
    with pytest.raises(ValueError, match="in_flight"):
        await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path="x", in_flight="drop")
    assert await fleet.redis.xlen(fleet.keys.control) == 0


# --------------------------------------------------------------------------- failover across versions

TURNS = [{"token_ids": [257, 260, 72, 105, 261], "sampling": {"max_tokens": 6, "seed": 5}},
         {"token_ids": [72, 105], "sampling": {"max_tokens": 5, "seed": 6}},
         {"token_ids": [105], "sampling": {"max_tokens": 7, "seed": 7, "temperature": 0.8}},
         {"token_ids": [260, 72], "sampling": {"max_tokens": 6, "seed": 8}}]


async def test_failover_after_a_weight_update_rebuilds_token_sessions_by_their_tokens(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts, tmp_path: Path
) -> None:
    """Steps 0-1 ran on version 0, step 2 on version 1; the worker dies. The new owner (version 1)
    cannot replay version-0 generations, so it feeds each recorded step with its generated tokens
    (nothing generated); a world-model session cannot be rebuilt and says why."""
    path = str(tmp_path / "v1.pt")
    engine(seed=1).save_weights(path)
    a = await workers.add(engine(), **FAST)
    t = await fleet.create_session(model="reference-lm", mode="tokens")
    w = await fleet.create_session(model="reference-world", mode="world_model_env")
    b = await workers.add(engine(), **FAST)
    assert t.owner == w.owner == a.id
    results = []
    for i in range(2):
        results.append(await t.step(i, **TURNS[i]))
        assert (await w.step(i, **world_step(i))).policy_version == 0
    for model in ("reference-lm", "reference-world"):  # versions are per model: move both
        await update_weights(fleet.redis, fleet.keys, model=model, version=1, path=path)
        await workers_at_version(fleet.redis, fleet.keys, model=model, version=1)
    results.append(await t.step(2, **TURNS[2]))
    assert (await w.step(2, **world_step(2))).policy_version == 1
    assert [r.policy_version for r in results] == [0, 0, 1]
    await workers.kill(a)
    await reap_until_moved(scripts, a.id)

    moved = await t.step(3, **TURNS[3])
    assert moved.ok and moved.worker_id == b.id and moved.policy_version == 1, moved.error
    direct_engine = engine(seed=1)  # the same context from the same tokens, then step 3
    for i, result in enumerate(results):
        record = {"generated": result.output["token_ids"]}
        forced = teacher_forced(TokenStep.from_wire(TURNS[i]), record)
        [out] = direct_engine.run_direct("reference-lm", [EngineRequest("d", "reference-lm", forced, reset=i == 0)])
        assert not isinstance(out, BaseException) and out.context_length == result.context_length
    [expected] = direct_engine.run_direct("reference-lm", [EngineRequest("d", "reference-lm",
                                                                        TokenStep.from_wire(TURNS[3]))])
    assert not isinstance(expected, BaseException)
    assert moved.output["token_ids"] == expected.output["token_ids"]
    assert moved.output["logprobs"] == expected.output["logprobs"]
    assert moved.context_length == expected.context_length

    lost = await w.step(3, **world_step(3))
    assert lost.error is not None and lost.error.code is ErrorCode.CONTEXT_LOST
    assert "policy version 0" in lost.error.message and lost.committed_step_id == 2


async def test_an_engine_that_aborts_steps_on_its_own_fails_them_like_any_engine_error(
    fleet: FleetClient, workers: WorkerPool
) -> None:
    """Only an aborting weight update makes a step run again; otherwise StepAborted is an engine
    error (retried, then answered and dead-lettered), never an endless loop."""

    class SelfAborting(NullEngine):
        async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
            return [StepAborted("aborted by the engine itself") for _ in requests]

    await workers.add(SelfAborting(), max_attempts=2, retry_backoff_ms=1)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    r = await asyncio.wait_for(s.step(0, **world_step(0)), 10)
    assert r.error is not None and r.error.code is ErrorCode.INFERENCE_ERROR and r.attempt == 2
    assert "aborted by the engine itself" in r.error.message
    assert await fleet.redis.xlen(fleet.keys.dead) == 1


async def test_a_step_let_in_without_waiting_holds_an_update_until_it_leaves() -> None:
    """WeightGate.enter_now, the step path's entry: None wherever step() would wait (an update holds
    the gate, the version is not there yet); a step it let in keeps an update out until it leaves."""
    null = NullEngine()
    gate = WeightGate(null)
    assert gate.enter_now(1, model="null-world") is None and gate.running == 0  # version 0 < 1: would wait
    version = gate.enter_now(0, model="null-world")
    assert version == 0 and gate.running == 1
    update = asyncio.create_task(gate.update("unused", 1))
    await asyncio.sleep(0.05)
    assert not update.done() and gate.enter_now(0, model="null-world") is None  # closed while it drains
    gate.leave()
    await asyncio.wait_for(update, 5)
    assert gate.running == 0 and gate.enter_now(1, model="null-world") == 1
    gate.leave()
