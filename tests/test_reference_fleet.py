"""The reference engines through the fleet: fidelity, determinism, reset, stateless, KV context."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from broker import FleetClient
from schemas.messages import TokenStep, WorldStep
from schemas.reference_tokenizer import ReferenceTokenizer
from tests.support import WorkerPool, world_step
from workers.engines.base import EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

pytestmark = pytest.mark.asyncio

SHAPE = (1, 4, 2, 8, 10)  # small latents keep the tests fast; the default is (1, 16, 2, 44, 80)
TOK = ReferenceTokenizer()


def engine() -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE))


def prompt_ids(i: int) -> list[int]:
    return TOK.apply_chat_template([{"role": "user", "content": f"what is {i} + {i}?"}], add_generation_prompt=True)


def token_step(i: int, turn: int) -> dict:  # type: ignore[type-arg]
    ids = prompt_ids(i) if turn == 0 else TOK.encode(f"\nturn {turn}: no, try again\n")
    return {"token_ids": ids, "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 7}}


async def test_world_results_equal_a_direct_engine_call(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    await workers.add(engine())
    sessions = [await fleet.create_session(model="reference-world", mode="world_model_env") for _ in range(4)]

    async def run(k: int, s):  # type: ignore[no-untyped-def]
        return [await s.step(i, **world_step(i, seed=k)) for i in range(5)]

    via_fleet = await asyncio.gather(*[run(k, s) for k, s in enumerate(sessions)])
    direct = engine()
    for k, results in enumerate(via_fleet):
        for i, r in enumerate(results):
            assert r.ok, r.error
            req = EngineRequest(f"direct-{k}", "reference-world", WorldStep.from_wire(world_step(i, seed=k)),
                                reset=i == 0)
            expected = direct.run_direct("reference-world", [req])[0]
            assert not isinstance(expected, BaseException)
            assert r.output["video_latent"].tobytes() == expected.output["video_latent"].tobytes()
            assert r.output["video_latent"].shape == SHAPE


async def test_token_results_equal_a_direct_engine_call(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    direct = engine()
    for turn in range(3):
        r = await s.step(turn, **token_step(1, turn))
        assert r.ok, r.error
        req = EngineRequest("direct", "reference-lm", TokenStep.from_wire(token_step(1, turn)), reset=turn == 0)
        expected = direct.run_direct("reference-lm", [req])[0]
        assert not isinstance(expected, BaseException)
        assert r.output["token_ids"] == expected.output["token_ids"]
        assert r.output["logprobs"] == expected.output["logprobs"]
        assert r.output["finish_reason"] == expected.output["finish_reason"]
        assert r.context_length == expected.context_length


async def test_fresh_sessions_with_the_same_inputs_agree(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    await workers.add(engine())
    a = await fleet.create_session(model="reference-lm", mode="tokens")
    b = await fleet.create_session(model="reference-lm", mode="tokens")
    assert a.owner != b.owner  # different workers, same answer
    ra, rb = await asyncio.gather(a.step(0, **token_step(3, 0)), b.step(0, **token_step(3, 0)))
    assert ra.output["token_ids"] == rb.output["token_ids"] and ra.output["logprobs"] == rb.output["logprobs"]
    wa = await fleet.create_session(model="reference-world", mode="world_model_env")
    wb = await fleet.create_session(model="reference-world", mode="world_model_env")
    ra, rb = await asyncio.gather(wa.step(0, **world_step(0)), wb.step(0, **world_step(0)))
    assert np.array_equal(ra.output["video_latent"], rb.output["video_latent"])


async def test_world_output_depends_on_history_and_reset_forgets_it(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    s = await fleet.create_session(model="reference-world", mode="world_model_env")
    first = await s.step(0, **world_step(0))
    second = await s.step(1, **world_step(0))  # same inputs, later in the episode
    assert not np.array_equal(first.output["video_latent"], second.output["video_latent"])
    assert await s.reset() == -1
    again = await s.step(0, **world_step(0))
    assert np.array_equal(again.output["video_latent"], first.output["video_latent"])


async def test_stateless_step_equals_a_new_sessions_first_step(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    first = await s.step(0, **token_step(2, 0))
    turn1 = await s.step(1, **token_step(2, 1))
    stateless = await s.step(77, use_session_context=False, **token_step(2, 0))
    assert stateless.ok and stateless.step_id == 77
    assert stateless.output["token_ids"] == first.output["token_ids"]
    assert (await s.status()).committed_step_id == 1
    # the session's context is untouched by the stateless step
    other = await fleet.create_session(model="reference-lm", mode="tokens")
    await other.step(0, **token_step(2, 0))
    await other.step(1, **token_step(2, 1))
    r2, o2 = await asyncio.gather(s.step(2, **token_step(2, 2)), other.step(2, **token_step(2, 2)))
    assert r2.output["token_ids"] == o2.output["token_ids"] and turn1.ok


async def test_token_context_persists_across_turns(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    r0 = await s.step(0, **token_step(4, 0))
    r1 = await s.step(1, **token_step(4, 1))
    assert r1.context_length == r0.context_length + len(token_step(4, 1)["token_ids"]) + len(r1.output["token_ids"])
    assert (await s.status()).context_length == r1.context_length
    # the same turn-1 tokens with no history give a different continuation
    fresh = await fleet.create_session(model="reference-lm", mode="tokens")
    alone = await fresh.step(0, **token_step(4, 1))
    assert alone.output["logprobs"] != r1.output["logprobs"]


async def test_routed_experts_come_back_when_asked(fleet: FleetClient, workers: WorkerPool) -> None:
    await workers.add(engine())
    s = await fleet.create_session(model="reference-lm", mode="tokens")
    r = await s.step(0, return_routed_experts=True, **token_step(5, 0))
    experts = r.output["routed_experts"]
    assert experts.ndim == 3 and experts.shape[0] == r.context_length - 1
