"""Partial rollouts on vLLM in process (a tiny local Llama on CPU): a weight update with
``in_flight="continue"`` aborts a long greedy step through vLLM's own abort, keeps the tokens it
generated and continues from them on the other weights; ``weight_versions`` says which is which."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from broker import FleetClient
from broker.ops.weights import update_weights, workers_at_version
from broker.redis.embedded import RedisServer
from schemas.messages import TokenStep
from tests.engines.conftest import MODEL_NAME, VLLM_ENV, SharedEngine, requires_vllm
from tests.support import worker_pool
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

pytestmark = [pytest.mark.engines, requires_vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [1, 5, 205, 278, 267, 307, 291, 335, 37, 2, 205, 6, 205]  # as in test_vllm_engines
MAX_TOKENS = 800  # a step of about 2 s
# min_tokens: the step never stops early, on either weights and from wherever the update cut it
# (greedy on the other weights from a timing-dependent prefix can otherwise reach EOS).
LONG: dict[str, Any] = {"token_ids": PROMPT, "sampling": {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
                                                          "temperature": 0.0}}
NEXT: dict[str, Any] = {"token_ids": [2, 205, 5, 205], "sampling": {"max_tokens": 4, "temperature": 0.0}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: str) -> AsyncIterator[VLLMEngine]:
    started = VLLMEngine(VLLMEngineConfig(model=tiny_model, served_model_name=MODEL_NAME, dtype="float32",
                                          max_model_len=1024, enforce_eager=True, env=VLLM_ENV))
    await started.start()
    yield started
    await started.close()


async def stateless(engine: VLLMEngine, wire: dict[str, Any]) -> dict[str, Any]:
    [out] = await engine.run_batch(MODEL_NAME, [EngineRequest("probe", MODEL_NAME, TokenStep.from_wire(wire),
                                                              stateless=True)])
    assert isinstance(out, EngineOutput), out
    return dict(out.output)


async def test_continue_keeps_the_tokens_generated_before_the_update(
        redis_server: RedisServer, engine: VLLMEngine, tiny_model_v2: str) -> None:
    old = await stateless(engine, LONG)  # the whole step on the original weights
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(redis_server.url, prefix) as pool, FleetClient(redis_server.url, prefix=prefix) as fleet:
        w = await pool.add(SharedEngine(engine))
        s = await fleet.create_session(model=MODEL_NAME, mode="tokens")
        running = s.submit(0, **LONG)
        for _ in range(500):
            if w.worker.weights is not None and w.worker.weights.gate.running:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # some tokens on the original weights; the step takes seconds
        await update_weights(fleet.redis, fleet.keys, model=MODEL_NAME, version=1, path=tiny_model_v2,
                             in_flight="continue")
        first = await asyncio.wait_for(running, 120)
        await workers_at_version(fleet.redis, fleet.keys, model=MODEL_NAME, version=1, timeout=120)
        assert first.ok and first.policy_version == 1, first.error
        versions = first.output["weight_versions"]
        kept = versions.count(0)
        assert 0 < kept < MAX_TOKENS and versions == [0] * kept + [1] * (MAX_TOKENS - kept), versions
        tokens = first.output["token_ids"]
        assert len(tokens) == MAX_TOKENS and first.output["finish_reason"] == "length"
        assert tokens[:kept] == old["token_ids"][:kept]
        assert first.output["logprobs"][:kept] == old["logprobs"][:kept]
        assert first.context_length == len(PROMPT) + MAX_TOKENS
        assert engine.context(s.session_id) == [*PROMPT, *tokens]  # prompt + every generated token
        assert tokens != old["token_ids"]  # the rest came from the other weights
        second = await s.step(1, **NEXT)
        assert second.ok and second.output["weight_versions"] == [1] * len(second.output["token_ids"])
        assert second.context_length == len(PROMPT) + MAX_TOKENS + len(NEXT["token_ids"]) + 4
