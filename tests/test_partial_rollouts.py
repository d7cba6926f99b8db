"""Partial rollouts: a weight update with ``in_flight="continue"`` keeps the tokens a running step
generated and continues from them on the new weights; every token step reports the version of
each of its tokens (``weight_versions``). The engine holds each step at a known token until the
abort arrives (tests/holding_engine.py), so what ran on which weights is exact."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from broker import FleetClient
from broker.ops.weights import WeightUpdate, update_weights, workers_at_version
from broker.redis.embedded import RedisServer
from broker.redis.scripts import Scripts
from broker.rollouts.multiturn import MultiTurnConfig, RolloutStatus, run_multiturn
from schemas.errors import StepAborted
from schemas.messages import TokenStep, WorldStep
from tests.holding_engine import HoldingConfig, HoldingEngine
from tests.procs import Fleet
from tests.support import FAST, WorkerPool, reap_until_moved, run_cli, world_step
from tests.test_multiturn import QUESTION, MathEnv
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.partial import PartialAbort
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig
from workers.engines.reference_lm import ReferenceLMConfig
from workers.executor import Continuation

pytestmark = pytest.mark.asyncio
SHAPE = (1, 4, 2, 8, 10)
HOLD = 20  # tokens generated on the old weights before the update
PROMPT = [257, 260, 72, 105, 261]
LONG = {"token_ids": PROMPT, "sampling": {"max_tokens": 60, "seed": 7, "temperature": 0.8}}
NEXT = {"token_ids": [72, 105], "sampling": {"max_tokens": 5, "seed": 8}}
NO_EOS = ReferenceLMConfig(eos_token_id=-1)  # every step generates exactly max_tokens


def holding(**extra: Any) -> HoldingEngine:
    return HoldingEngine(HoldingConfig(latent_shape=SHAPE, lm=NO_EOS, hold_after=HOLD, **extra))


def reference(seed: int) -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, seed=seed, lm=NO_EOS))


def direct(engine: ReferenceEngine, wire: dict[str, Any], *, key: str = "d", reset: bool = False) -> EngineOutput:
    [out] = engine.run_direct("reference-lm", [EngineRequest(key, "reference-lm", TokenStep.from_wire(wire),
                                                            reset=reset)])
    assert isinstance(out, EngineOutput), out
    return out


def continued(kept: list[int]) -> dict[str, Any]:
    """The step the worker runs after the update: the kept tokens appended, the budget reduced."""
    sampling = {**LONG["sampling"], "max_tokens": 60 - len(kept)}  # type: ignore[dict-item]
    return {"token_ids": [*PROMPT, *kept], "sampling": sampling}


async def wait_held(engine: HoldingEngine) -> None:
    assert await asyncio.to_thread(engine.held.wait, 30), "the step never reached its hold point"


@pytest.fixture
def v1(tmp_path: Path) -> str:
    path = str(tmp_path / "v1.pt")
    reference(1).save_weights(path)
    return path


async def test_continue_keeps_the_generated_prefix_and_reports_each_tokens_version(
    fleet: FleetClient, workers: WorkerPool, scripts: Scripts, v1: str
) -> None:
    old = direct(reference(0), LONG).output
    a = await workers.add(engine := holding(), **FAST)
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    running = s.submit(0, **LONG)
    await wait_held(engine)
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=v1, in_flight="continue")
    first = await asyncio.wait_for(running, 60)
    assert first.ok and first.policy_version == 1, first.error
    kept = old["token_ids"][:HOLD]
    rest = direct(reference(1), continued(kept)).output  # the generation goes on from the kept tokens
    assert first.output["token_ids"] == [*kept, *rest["token_ids"]]
    assert first.output["logprobs"] == [*old["logprobs"][:HOLD], *rest["logprobs"]]
    assert first.output["weight_versions"] == [0] * HOLD + [1] * (60 - HOLD)
    assert len(first.output["token_ids"]) == 60 and first.output["finish_reason"] == "length"
    assert first.context_length == len(PROMPT) + 60

    # The engine's context is the prompt plus every generated token: the next step shows it.
    direct_engine = reference(1)
    direct(direct_engine, {"token_ids": [*PROMPT, *first.output["token_ids"]], "sampling": {"max_tokens": 0}},
           reset=True)
    expected = direct(direct_engine, NEXT).output
    second = await s.step(1, **NEXT)
    assert second.ok and second.output["token_ids"] == expected["token_ids"]
    assert second.output["weight_versions"] == [1] * len(expected["token_ids"])  # one version: all equal

    # A new owner rebuilds the context from the records (the continued step is teacher-forced).
    b = await workers.add(reference(0), **FAST)  # loads version 1 as it starts
    await workers.kill(a)
    await reap_until_moved(scripts, a.id)
    third = NEXT | {"token_ids": [105]}
    after = direct(direct_engine, third)
    moved = await s.step(2, **third)
    assert moved.ok and moved.worker_id == b.id, moved.error
    assert moved.output["token_ids"] == after.output["token_ids"] and moved.context_length == after.context_length


@pytest.mark.parametrize("in_flight", ["abort", "finish"])
async def test_abort_runs_the_step_again_whole_and_finish_keeps_the_old_weights(
    fleet: FleetClient, workers: WorkerPool, v1: str, in_flight: str
) -> None:
    engine = holding(hold_s=0.0 if in_flight == "finish" else 60.0)  # finish: nothing to wait for
    await workers.add(engine)
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    running = s.submit(0, **LONG)
    await wait_held(engine)
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=v1, in_flight=in_flight)
    first = await asyncio.wait_for(running, 60)
    version = 1 if in_flight == "abort" else 0
    expected = direct(reference(version), LONG).output
    assert first.ok and first.policy_version == version, first.error
    assert first.output["token_ids"] == expected["token_ids"]
    assert first.output["weight_versions"] == [version] * 60


async def test_a_world_model_step_under_continue_runs_again_whole(
    fleet: FleetClient, workers: WorkerPool, v1: str
) -> None:
    engine = holding()
    await workers.add(engine)
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    running = s.submit(0, **world_step(0))
    await wait_held(engine)
    await update_weights(fleet.redis, fleet.keys, model="reference-world", version=1, path=v1, in_flight="continue")
    result = await asyncio.wait_for(running, 60)
    [out] = reference(1).run_direct("reference-world", [EngineRequest("d", "reference-world",
                                                                      WorldStep.from_wire(world_step(0)))])
    assert result.ok and result.policy_version == 1, result.error
    assert isinstance(out, EngineOutput) and "weight_versions" not in result.output
    assert result.output["video_latent"].tobytes() == out.output["video_latent"].tobytes()


async def test_kept_tokens_add_up_over_updates_and_a_plain_abort_drops_them() -> None:
    step = TokenStep.from_wire(LONG)
    runs = Continuation(EngineRequest("s", "reference-lm", step))
    assert runs.aborted(PartialAbort("x", [1, 2], [-0.1, -0.2]), 3, keep=True) == 2
    assert runs.aborted(StepAborted("no partial output"), 4, keep=True) == 2  # nothing new to keep
    assert runs.aborted(PartialAbort("x", [5], [-0.5]), 4, keep=True) == 3
    assert isinstance(runs.request.step, TokenStep)
    assert runs.request.step.token_ids == (*PROMPT, 1, 2, 5) and runs.request.step.sampling.max_tokens == 57
    out = runs.output(EngineOutput({"token_ids": [7, 8], "logprobs": [-0.7, -0.8], "finish_reason": "length"}, 10), 5)
    assert out.output["token_ids"] == [1, 2, 5, 7, 8] and out.output["logprobs"] == [-0.1, -0.2, -0.5, -0.7, -0.8]
    assert out.output["weight_versions"] == [3, 3, 4, 5, 5] and out.context_length == 10
    assert runs.aborted(PartialAbort("x", [9], [-0.9]), 5, keep=False) == 0  # abort: the step runs whole
    assert runs.request.step == step
    at_least = TokenStep.from_wire({**LONG, "sampling": {**LONG["sampling"], "min_tokens": 50}})
    runs = Continuation(EngineRequest("s", "reference-lm", at_least))
    runs.aborted(PartialAbort("x", [1, 2, 3], [-0.1, -0.2, -0.3]), 3, keep=True)
    assert isinstance(runs.request.step, TokenStep)  # the kept tokens count against both budgets
    assert (runs.request.step.sampling.min_tokens, runs.request.step.sampling.max_tokens) == (47, 57)
    world = EngineOutput({"video_latent": b""}, 1)
    assert Continuation(EngineRequest("w", "reference-world", WorldStep.from_wire(world_step(0)))).output(world, 2) \
        is world


async def test_the_control_stream_takes_only_known_in_flight_policies() -> None:
    fields = {b"kind": b"update_weights", b"model": b"m", b"version": b"2", b"path": b"/p"}
    update = WeightUpdate.from_fields({**fields, b"in_flight": b"continue"})
    assert update is not None and update.abort and update.keep_partial
    assert WeightUpdate.from_fields({**fields, b"in_flight": b"sideways"}) is None
    plain = WeightUpdate.from_fields(fields)
    assert plain is not None and plain.in_flight == "finish" and not plain.abort and not plain.keep_partial


@pytest.mark.slow  # a worker process (torch import, engine start)
async def test_continue_through_the_cli_with_a_worker_process(
    redis_server: RedisServer, prefix: str, tmp_path: Path, v1: str, capsys: pytest.CaptureFixture[str]
) -> None:
    signal = tmp_path / "held"
    procs = Fleet(redis_server.url, prefix)
    try:
        options = {"latent_shape": "[1,4,2,8,10]", "lm": '{"eos_token_id":-1}', "hold_after": str(HOLD),
                   "signal_path": str(signal)}
        procs.worker(*[f"--engine-opt={key}={value}" for key, value in options.items()],
                     engine="tests.holding_engine:HoldingEngine")
        await procs.wait_active(1)
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            s = await fleet.create_session(model="reference-lm", mode="tokens")
            running = s.submit(0, **LONG)
            deadline = time.monotonic() + 60
            while not signal.exists():
                assert time.monotonic() < deadline and not running.done(), "the step never held"
                await asyncio.sleep(0.02)
            code, said, err = await run_cli(capsys, "update-weights", "--redis-url", redis_server.url, "--prefix",
                                           prefix, "--model", "reference-lm", "--version", "1", "--path", v1,
                                           "--in-flight", "continue", "--wait", "60")
            assert code == 0 and "announced reference-lm version 1" in said, err
            first = await asyncio.wait_for(running, 60)
            await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1)
    finally:
        procs.close()
    old = direct(reference(0), LONG).output
    kept = old["token_ids"][:HOLD]
    assert first.ok and first.policy_version == 1, first.error
    assert first.output["token_ids"] == [*kept, *direct(reference(1), continued(kept)).output["token_ids"]]
    assert first.output["weight_versions"] == [0] * HOLD + [1] * (60 - HOLD)


async def test_the_multiturn_driver_keeps_each_generated_tokens_version(
    fleet: FleetClient, workers: WorkerPool, v1: str
) -> None:
    await workers.add(engine := holding(), **FAST)
    config = MultiTurnConfig(max_turns=2, max_new_tokens=60, seed=7)
    running = asyncio.ensure_future(run_multiturn(fleet, MathEnv(), QUESTION, config))
    await wait_held(engine)
    await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=v1, in_flight="continue")
    sample = await asyncio.wait_for(running, 60)
    # One turn of exactly 60 generated tokens (no EOS): 20 on version 0, the rest continued on 1.
    assert sample.status is RolloutStatus.TRUNCATED and sample.turns == 1
    assert sample.weight_versions == [0] * HOLD + [1] * (60 - HOLD)
    assert len(sample.weight_versions) == sum(sample.loss_mask) == sample.response_length
