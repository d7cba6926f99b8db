"""The vLLM engines for real on CPU (a tiny local Llama): through the fleet, token ids, log probs,
finish reasons and context lengths equal vLLM's own offline ``LLM.generate`` on the same contexts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from broker import FleetClient
from broker.redis.embedded import RedisServer
from schemas.messages import TokenStep
from tests.engines.conftest import (
    MODEL_NAME,
    MOE_NAME,
    VLLM_ENGINE_KW,
    VLLM_ENV,
    SharedEngine,
    VLLMServices,
    requires_vllm,
)
from tests.support import reap_until_moved, until, worker_pool
from workers.engines.base import Engine, EngineRequest
from workers.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine

pytestmark = [pytest.mark.engines, requires_vllm, pytest.mark.asyncio(loop_scope="module")]

# "<s><|user|>\nwhat is 2 + 3?</s>\n<|assistant|>\n" in the tiny model's tokenizer, and later turns.
PROMPT = [1, 5, 205, 278, 267, 307, 291, 335, 37, 2, 205, 6, 205]
TURN = [2, 205, 5, 205, 303, 310, 2, 205, 6, 205]
STOPS = list(range(0, 400, 3))  # a third of the vocabulary: generation stops early
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 7}},
     {"token_ids": TURN, "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 7}},
     {"token_ids": TURN[:4], "sampling": {"max_tokens": 6, "temperature": 0.7, "seed": 8}}],
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 6, "temperature": 0.0}},
     {"token_ids": TURN, "sampling": {"max_tokens": 6, "temperature": 1.2, "top_p": 0.9, "top_k": 20, "seed": 3}},
     {"token_ids": [205, 300], "sampling": {"max_tokens": 5, "temperature": 1.0}}],
    [{"token_ids": PROMPT[:5], "sampling": {"max_tokens": 12, "seed": 11, "stop_token_ids": STOPS}},
     {"token_ids": TURN, "sampling": {"max_tokens": 12, "seed": 12, "stop_token_ids": STOPS}},
     {"token_ids": [205], "sampling": {"max_tokens": 4, "seed": 13}}],
    # The wider sampling API: penalties, min_tokens with stop tokens, top-k log probs, stop strings.
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 10, "temperature": 0.0, "repetition_penalty": 1.5,
                                        "frequency_penalty": 0.5, "presence_penalty": 0.5, "logprobs": 3}},
     {"token_ids": TURN, "sampling": {"max_tokens": 10, "seed": 14, "min_tokens": 6, "stop_token_ids": STOPS}},
     {"token_ids": [205], "sampling": {"max_tokens": 12, "seed": 15, "stop": ["e", "an", "in"]}}],
    # Each option alone. Greedy from PROMPT the tiny Llama says "p", "ef", ...: "pef" is a stop string
    # of two tokens. Sampled at temperature 1 its tokens are far from the top 5 (whose list then lacks
    # them); greedy (above, logprobs 3) they are the first of it.
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 8, "temperature": 0.0, "stop": ["never", "pef"]}},
     {"token_ids": TURN, "sampling": {"max_tokens": 8, "seed": 16, "logprobs": 5}},
     {"token_ids": [205], "sampling": {"max_tokens": 8, "seed": 17, "presence_penalty": 1.5}}],
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 8, "temperature": 0.8, "seed": 18, "frequency_penalty": 1.0}},
     {"token_ids": TURN, "sampling": {"max_tokens": 8, "temperature": 0.0, "repetition_penalty": 1.3}},
     {"token_ids": [205], "sampling": {"max_tokens": 8, "seed": 19, "min_tokens": 4, "stop_token_ids": STOPS,
                                       "logprobs": 2}}],
]
# Greedy from PROMPT, the tiny Llama never emits its end token: a long step (about 2 s) to abort.
LONG_TURN: dict[str, Any] = {"token_ids": PROMPT, "sampling": {"max_tokens": 1000, "temperature": 0.0}}
WEIGHT_CONVERSATIONS: list[list[dict[str, Any]]] = [[LONG_TURN], CONVERSATIONS[0]]  # offline on the v2 weights
MOE_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"token_ids": PROMPT, "sampling": {"max_tokens": 6, "seed": 21}, "return_routed_experts": True},
     {"token_ids": TURN, "sampling": {"max_tokens": 6, "seed": 22}, "return_routed_experts": True}],
    [{"token_ids": PROMPT[:7], "sampling": {"max_tokens": 5, "temperature": 0.0}, "return_routed_experts": True},
     {"token_ids": TURN[:3], "sampling": {"max_tokens": 5, "seed": 5}, "return_routed_experts": True}],
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def inproc(tiny_model: str) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(VLLMEngineConfig(model=tiny_model, served_model_name=MODEL_NAME,
                                         dtype=str(VLLM_ENGINE_KW["dtype"]),
                                         max_model_len=int(str(VLLM_ENGINE_KW["max_model_len"])),
                                         enforce_eager=True, env=VLLM_ENV))
    await engine.start()
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def inproc_moe(tiny_moe: str) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(VLLMEngineConfig(model=tiny_moe, served_model_name=MOE_NAME, dtype="float32",
                                         max_model_len=1024, enforce_eager=True, enable_return_routed_experts=True,
                                         env=VLLM_ENV))
    await engine.start()
    yield engine
    await engine.close()


def http_engine(services: VLLMServices) -> VLLMHTTPEngine:
    return VLLMHTTPEngine(VLLMHTTPConfig(base_url=services.server.url, model=MODEL_NAME))


async def run_conversations(url: str, engines: list[Any], conversations: list[list[dict[str, Any]]] = CONVERSATIONS,
                            model: str = MODEL_NAME) -> list[list[Any]]:
    """Conversations through a fleet of in-process workers, concurrently; results per turn."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        for engine in engines:
            await pool.add(engine)
        sessions = [await fleet.create_session(model=model, mode="tokens") for _ in conversations]

        async def run(session: Any, turns: list[dict[str, Any]]) -> list[Any]:
            return [await session.step(i, **turn) for i, turn in enumerate(turns)]

        return await asyncio.gather(*(run(s, c) for s, c in zip(sessions, conversations, strict=True)))


def assert_equal_to_offline(results: list[list[Any]], offline: list[list[dict[str, Any]]],
                            reasons: set[str] | None = None) -> None:
    for conv, (got, expected) in enumerate(zip(results, offline, strict=True)):
        for turn, (r, e) in enumerate(zip(got, expected, strict=True)):
            where = f"conversation {conv} turn {turn}"
            assert r.ok, (where, r.error)
            assert r.output["token_ids"] == e["token_ids"], where
            assert r.output["logprobs"] == e["logprobs"], where  # bitwise: same floats
            assert r.output["finish_reason"] == e["finish_reason"], where
            assert r.context_length == e["context_length"], where
            for key in ("top_logprobs", "stop_reason"):  # absent on both sides when not asked / not stopped so
                assert r.output.get(key) == e.get(key), (where, key)
            if "routed_experts" in e:
                assert r.output["routed_experts"].tolist() == e["routed_experts"], where
    seen = {e["finish_reason"] for conv in offline for e in conv}
    assert seen == (reasons or {"stop", "length"}), seen  # both ways of finishing are covered


async def test_offline_answers_cover_the_sampling_api(vllm_services: VLLMServices) -> None:
    """The comparisons with vLLM's answers test something: those answers hold a stop string that the
    last token completes without holding it alone, a stop token id, and top-k lists that hold the
    sampled token and lists that do not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_services.model, local_files_only=True)
    answers = [e for conv in vllm_services.offline for e in conv]
    strings = [e for e in answers if isinstance(e.get("stop_reason"), str)]
    assert any(e["stop_reason"] not in tok.decode(e["token_ids"][-1:]) for e in strings), strings
    assert any(isinstance(e.get("stop_reason"), int) and e["token_ids"][-1] == e["stop_reason"] for e in answers)
    positions = [(token, [t for t, _ in top]) for e in answers if "top_logprobs" in e
                 for token, top in zip(e["token_ids"], e["top_logprobs"], strict=True)]
    assert any(token in top for token, top in positions) and any(token not in top for token, top in positions)
    assert all(len(top) == len(set(top)) for _, top in positions)


async def test_inprocess_engine_through_fleet_equals_offline_generate(
        redis_server: RedisServer, vllm_services: VLLMServices, inproc: VLLMEngine) -> None:
    results = await run_conversations(redis_server.url, [SharedEngine(inproc)])
    assert_equal_to_offline(results, vllm_services.offline)


async def test_routed_experts_through_fleet_equal_offline_generate(
        redis_server: RedisServer, vllm_services: VLLMServices, inproc_moe: VLLMEngine) -> None:
    results = await run_conversations(redis_server.url, [SharedEngine(inproc_moe)], MOE_CONVERSATIONS, MOE_NAME)
    assert_equal_to_offline(results, vllm_services.offline_moe, reasons={"length"})
    for conv in results:
        for r in conv:  # one row per context token but the last, (layers, top_k) each
            assert r.output["routed_experts"].shape == (r.context_length - 1, 2, 2)
    assert all("routed_experts" in e for conv in vllm_services.offline_moe for e in conv)


async def test_http_engine_through_fleet_equals_offline_generate(
        redis_server: RedisServer, vllm_services: VLLMServices) -> None:
    results = await run_conversations(redis_server.url, [http_engine(vllm_services), http_engine(vllm_services)])
    assert_equal_to_offline(results, vllm_services.offline)
    assert len({r.worker_id for conv in results for r in conv}) == 2  # sessions spread over both workers


async def test_http_engine_equals_a_direct_server_call(vllm_services: VLLMServices) -> None:
    engine = http_engine(vllm_services)
    turn = CONVERSATIONS[0][0]
    out = (await engine.run_batch(MODEL_NAME, [EngineRequest("s", MODEL_NAME, TokenStep.from_wire(turn),
                                                             reset=True)]))[0]
    assert not isinstance(out, BaseException), out
    body = {"model": MODEL_NAME, "token_ids": turn["token_ids"],
            "sampling_params": {**turn["sampling"], "logprobs": 0}}
    async with httpx.AsyncClient(base_url=vllm_services.server.url) as client:
        direct = (await client.post("/inference/v1/generate", json=body)).json()["choices"][0]
    assert out.output["token_ids"] == direct["token_ids"]
    assert out.output["logprobs"] == [c["logprob"] for c in direct["logprobs"]["content"]]
    await engine.close()


async def test_render_chat_gives_the_chat_template_ids(vllm_services: VLLMServices) -> None:
    engine = http_engine(vllm_services)
    ids, features = await engine.render_chat([{"role": "user", "content": "what is 2 + 3?"}])
    assert ids == PROMPT and features is None
    await engine.close()


async def test_context_stateless_and_reset(redis_server: RedisServer, vllm_services: VLLMServices,
                                           inproc: VLLMEngine) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    turns = CONVERSATIONS[0]
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        await pool.add(SharedEngine(inproc))
        s = await fleet.create_session(model=MODEL_NAME, mode="tokens")
        first = await s.step(0, **turns[0])
        second = await s.step(1, **turns[1])
        stateless = await s.step(50, use_session_context=False, **turns[0])
        assert stateless.ok and stateless.output["token_ids"] == first.output["token_ids"]
        assert (await s.status()).committed_step_id == 1
        assert inproc.context(s.session_id) == [*turns[0]["token_ids"], *first.output["token_ids"],
                                                *turns[1]["token_ids"], *second.output["token_ids"]]
        assert await s.reset() == -1
        again = await s.step(0, **turns[0])
        assert again.output["logprobs"] == first.output["logprobs"]
        assert again.context_length == first.context_length
        await s.close()


async def test_bad_input_is_invalid_request_and_never_retried(redis_server: RedisServer,
                                                              vllm_services: VLLMServices,
                                                              inproc: VLLMEngine) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        await pool.add(SharedEngine(inproc))
        await pool.add(http_engine(vllm_services))
        for _ in range(2):
            s = await fleet.create_session(model=MODEL_NAME, mode="tokens")
            r = await s.step(0, token_ids=[1, 5000], sampling={"max_tokens": 4})  # out of the vocabulary
            assert not r.ok and r.error.code.value == "invalid_request" and r.attempt == 1, r
            too_long = await s.step(0, token_ids=[5] * 1100, sampling={"max_tokens": 4})
            assert not too_long.ok and too_long.error.code.value == "invalid_request", too_long
            ok = await s.step(0, **CONVERSATIONS[0][0])  # the failures changed nothing
            assert ok.ok and ok.context_length == len(PROMPT) + len(ok.output["token_ids"])


async def test_failover_rebuilds_the_context_on_another_engine_kind(
        redis_server: RedisServer, vllm_services: VLLMServices, inproc: VLLMEngine) -> None:
    """A session starts on the in-process engine; its worker dies; the HTTP engine's worker takes it over,
    replays the committed token steps (each replayed output must match its committed digest) and the
    next turn still equals vLLM's offline answer."""
    from redis.asyncio import Redis

    from broker.redis.keys import CellKeys
    from broker.redis.scripts import Scripts

    fast = {"heartbeat_ms": 100, "lease_ms": 500}
    prefix = f"t{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    redis = Redis.from_url(url)
    scripts = Scripts(redis, CellKeys(prefix))
    turns, expected = CONVERSATIONS[1], vllm_services.offline[1]
    try:
        async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
            a = await pool.add(SharedEngine(inproc), **fast)
            s = await fleet.create_session(model=MODEL_NAME, mode="tokens")
            b = await pool.add(http_engine(vllm_services), **fast)
            for i in (0, 1):
                r = await s.step(i, **turns[i])
                assert r.ok and r.worker_id == a.id and r.output["token_ids"] == expected[i]["token_ids"]
            await pool.kill(a)
            # b reaps too (every worker does): whichever pass retires a, its sessions move
            await reap_until_moved(scripts, a.id, timeout=10.0, lease_ms=500)
            r = await s.step(2, **turns[2])
            assert r.ok and r.worker_id == b.id, r
            assert r.output["token_ids"] == expected[2]["token_ids"] and r.output["logprobs"] == expected[2]["logprobs"]
            assert r.context_length == expected[2]["context_length"]
            assert b.worker.executor.rebuilt_steps == 2
    finally:
        await redis.aclose()


async def generating(engine: Engine, step: asyncio.Future[Any], bound_s: float = 60.0) -> None:
    """Until the step's generation is running inside the engine (the gate alone is not enough:
    the step passes it before its request leaves for vLLM). AssertionError when the step ends or
    the bound passes first."""
    inner = engine.inner if isinstance(engine, SharedEngine) else engine

    async def running() -> bool:
        assert not step.done(), f"the step ended before its generation was seen running: {step.result()}"
        return bool(inner.load().running_steps)

    await until(running, f"no generation running after {bound_s}s", bound_s, poll_s=0.005)


async def taking_sessions(fleet: FleetClient, worker_id: str, bound_s: float = 60.0) -> None:
    """Until the worker's engine is ready in the registry. On two loaded cores the server can
    answer a health probe late while it generates a long step or reloads (workers/readiness.py):
    the worker then offers no capacity until its next probe, and a session created at once is
    refused. AssertionError with the registry's view after ``bound_s``."""
    key = fleet.keys.worker(worker_id)

    async def ready() -> bool:
        return await fleet.redis.hget(key, "engine_ready") != b"0"

    async def registry() -> Any:
        return await fleet.redis.hgetall(key)

    await until(ready, registry, bound_s)


async def check_weight_updates(url: str, services: VLLMServices, engine: Engine,
                               first_version: int) -> None:
    """Through the control stream: a long step is aborted by an update to the other weights and runs
    again, whole, on them; the next session answers as vLLM offline on those weights; a second update
    (letting steps finish) goes back to the original weights and their offline answers."""
    from broker.ops.weights import update_weights, workers_at_version

    prefix = f"t{uuid.uuid4().hex[:10]}"
    v1, v2 = first_version, first_version + 1
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        w = await pool.add(engine)
        long_session = await fleet.create_session(model=MODEL_NAME, mode="tokens")
        running = long_session.submit(0, **LONG_TURN)
        await generating(engine, running)  # on the original weights: the whole step takes 1-2 s
        await update_weights(fleet.redis, fleet.keys, model=MODEL_NAME, version=v1, path=services.model_v2,
                             in_flight="abort")
        long = await asyncio.wait_for(running, 120)
        await workers_at_version(fleet.redis, fleet.keys, model=MODEL_NAME, version=v1, timeout=120)
        assert not await fleet.redis.hget(fleet.keys.worker(w.id), "weights_error")
        assert w.worker.executor is not None
        # aborted by the update and run again, whole, on the new weights (all three in one message)
        assert (w.worker.executor.aborted_steps, long.ok, long.policy_version) == (1, True, v1), long
        await taking_sessions(fleet, w.id)
        session = await fleet.create_session(model=MODEL_NAME, mode="tokens")
        on_v1 = [await session.step(i, **turn) for i, turn in enumerate(CONVERSATIONS[0])]

        await update_weights(fleet.redis, fleet.keys, model=MODEL_NAME, version=v2, path=services.model)
        await workers_at_version(fleet.redis, fleet.keys, model=MODEL_NAME, version=v2, timeout=120)
        await taking_sessions(fleet, w.id)
        session = await fleet.create_session(model=MODEL_NAME, mode="tokens")
        on_v2 = [await session.step(i, **turn) for i, turn in enumerate(CONVERSATIONS[0])]
    assert all(r.policy_version == v1 for r in on_v1) and all(r.policy_version == v2 for r in on_v2)
    assert_equal_to_offline([[long], on_v1], services.offline_v2,
                            reasons={e["finish_reason"] for conv in services.offline_v2 for e in conv})
    assert_equal_to_offline([on_v2], [services.offline[0]],
                            reasons={e["finish_reason"] for e in services.offline[0]})
    assert on_v1[0].output["token_ids"] != on_v2[0].output["token_ids"]  # the weights did change


async def test_weight_updates_reload_vllm_in_process(
        redis_server: RedisServer, vllm_services: VLLMServices, inproc: VLLMEngine) -> None:
    """Near the end of this file: it moves the shared engine to policy version 2 (the original
    weights again, so later answers still equal vLLM's offline ones)."""
    await check_weight_updates(redis_server.url, vllm_services, SharedEngine(inproc), first_version=1)
    assert inproc.policy_version == 2


async def test_weight_updates_reload_the_vllm_server(redis_server: RedisServer, vllm_services: VLLMServices) -> None:
    """Last in this file: the server ends on policy version 4 (the original weights again)."""
    await check_weight_updates(redis_server.url, vllm_services, http_engine(vllm_services), first_version=3)
    restarted = http_engine(vllm_services)  # a worker that starts later learns the server's version
    await restarted.start()
    assert restarted.policy_version == 4
    await restarted.close()
