"""Multimodal token steps for real on CPU (a tiny local LLaVA): chat messages with images become
token ids and multimodal features through the vLLM server's ``/v1/chat/completions/render``;
multi-turn sessions with images, through the fleet and the ``vllm-http`` engine, equal vLLM's own
offline ``LLM.generate`` on the same images and contexts, token for token."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer
from tests.engines.conftest import VLLM_ENV, SharedEngine, VLMServices, cache_dir, requires_vllm
from tests.support import worker_pool
from workers.engines.base import Engine
from workers.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine

pytestmark = [pytest.mark.engines, requires_vllm, pytest.mark.asyncio]

VLM_MODEL = "tiny-llava"
TOKENS_PER_IMAGE = 4  # scripts/make_tiny_model.py: 32x32 images, 16x16 patches

# Per conversation, per turn: (images by index, the user's text, sampling).
VLM_TURNS: list[list[tuple[list[int], str, dict[str, Any]]]] = [
    [([0], "what is 2 + 3?", {"max_tokens": 8, "seed": 1}),
     ([1], "pick the red cup", {"max_tokens": 6, "seed": 2, "temperature": 0.7}),
     ([], "try again", {"max_tokens": 5, "seed": 3})],
    [([2, 0], "which one is the table?", {"max_tokens": 6, "temperature": 0.0}),
     ([], "no", {"max_tokens": 4, "seed": 5})],
    [([3], "what is 2 + 3?", {"max_tokens": 8, "seed": 1})],  # conversation 0's first turn, another image
]


def image(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def data_url(index: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image(index)).save(buf, format="PNG")  # lossless: the server sees these pixels
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(images: list[int], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def model_dir() -> Path:
    return cache_dir() / "tiny-llava"


def chat_ids(images: list[int], text: str) -> list[int]:
    """The turn through the tokenizer's chat template alone: one image token per image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    ids = tokenizer.apply_chat_template(messages(images, text), add_generation_prompt=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def offline_spec() -> list[list[dict[str, Any]]]:
    """VLM_TURNS for tests.engines.vllm_offline (after the tiny_llava fixture made the model)."""
    return [[{"token_ids": chat_ids(images, text), "sampling": sampling,
              "images": [image(i).tolist() for i in images]} for images, text, sampling in conv]
            for conv in VLM_TURNS]


def image_token_id() -> int:
    return int(json.loads((model_dir() / "config.json").read_text())["image_token_index"])


def expanded(ids: list[int]) -> list[int]:
    token = image_token_id()
    return [t for i in ids for t in ([i] * TOKENS_PER_IMAGE if i == token else [i])]


Rendered = list[list[tuple[list[int], dict[str, Any] | None]]]


async def render_all(server_url: str) -> Rendered:
    """Every turn through the server's render, checked against the chat template and the images."""
    engine = VLLMHTTPEngine(VLLMHTTPConfig(base_url=server_url, model=VLM_MODEL))
    rendered: Rendered = []
    for conv in VLM_TURNS:
        rendered.append([await engine.render_chat(messages(images, text)) for images, text, _ in conv])
    await engine.close()
    for conv, turns in zip(VLM_TURNS, rendered, strict=True):
        for (images, text, _), (ids, features) in zip(conv, turns, strict=True):
            assert ids == expanded(chat_ids(images, text))  # the server's render = the chat template
            if images:
                assert features is not None
                placeholders = features["mm_placeholders"]["image"]
                assert [p["length"] for p in placeholders] == [TOKENS_PER_IMAGE] * len(images)
                assert all(ids[p["offset"]] == image_token_id() for p in placeholders)
            else:
                assert features is None
    return rendered


async def run_fleet(url: str, engines: list[Engine], rendered: Rendered) -> list[list[Any]]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    async with worker_pool(url, prefix) as pool, FleetClient(url, prefix=prefix) as fleet:
        for engine in engines:
            await pool.add(engine)
        sessions = [await fleet.create_session(model=VLM_MODEL, mode="tokens") for _ in VLM_TURNS]

        async def run(session: Any, conv: list[Any], turns: list[Any]) -> list[Any]:
            out = []
            for i, ((_, _, sampling), (ids, features)) in enumerate(zip(conv, turns, strict=True)):
                extra = {} if features is None else {"multimodal": features}
                out.append(await session.step(i, token_ids=ids, sampling=sampling, **extra))
            return out

        return list(await asyncio.gather(*(run(s, c, t) for s, c, t in zip(sessions, VLM_TURNS, rendered,
                                                                             strict=True))))


def assert_equal_to_offline(results: list[list[Any]], offline: list[list[dict[str, Any]]]) -> None:
    token = image_token_id()
    for conv, (got, expected) in enumerate(zip(results, offline, strict=True)):
        for turn, (r, e) in enumerate(zip(got, expected, strict=True)):
            where = f"conversation {conv} turn {turn}"
            assert r.ok, (where, r.error)
            assert token not in e["token_ids"], where  # else the offline context would hold a stray image token
            assert r.output["token_ids"] == e["token_ids"], where
            assert r.output["logprobs"] == e["logprobs"], where
            assert r.output["finish_reason"] == e["finish_reason"], where
            assert r.context_length == e["context_length"], where
    # the same text with another image gives another answer: the images reach the model
    assert results[0][0].output["logprobs"] != results[2][0].output["logprobs"]


async def test_image_turns_through_the_http_engine_equal_offline_generate(
        redis_server: RedisServer, vlm_services: VLMServices) -> None:
    rendered = await render_all(vlm_services.server.url)
    engines: list[Engine] = [VLLMHTTPEngine(VLLMHTTPConfig(base_url=vlm_services.server.url, model=VLM_MODEL))
                             for _ in range(2)]
    assert_equal_to_offline(await run_fleet(redis_server.url, engines, rendered), vlm_services.offline)


async def test_image_turns_through_the_inprocess_engine_equal_offline_generate(
        redis_server: RedisServer, vlm_services: VLMServices, tiny_llava: str) -> None:
    rendered = await render_all(vlm_services.server.url)  # a trainer renders once, any engine runs it
    engine = VLLMEngine(VLLMEngineConfig(model=tiny_llava, served_model_name=VLM_MODEL, dtype="float32",
                                         max_model_len=1024, enforce_eager=True, env=VLLM_ENV,
                                         engine_args={"limit_mm_per_prompt": {"image": 8}}))
    try:
        await engine.start()
        results = await run_fleet(redis_server.url, [SharedEngine(engine)], rendered)
    finally:
        await engine.close()
    assert_equal_to_offline(results, vlm_services.offline)


# --------------------------------------------------------------------------- VLM rollouts for trainers


class RetryEnv:
    """Two model turns: a text observation after the first, done after the second."""

    def __init__(self) -> None:
        self.turns = self.closes = 0

    def reset(self) -> None:
        pass

    def step(self, response: str) -> tuple[str, bool, dict[str, Any]]:
        self.turns += 1
        return "try again", self.turns >= 2, {}

    def format_observation(self, observation: str) -> dict[str, str]:
        return {"role": "user", "content": observation}

    def close(self) -> None:
        self.closes += 1


def build_env(*, sample: Any, args: Any) -> RetryEnv:
    """This module is also the vime adapter's environment module."""
    return RetryEnv()


def first_turn_stop(offline: VLMServices) -> tuple[list[int], list[float], int]:
    """vLLM offline's answer to VLM_TURNS[0][0] (image 0, "what is 2 + 3?", seed 1) cut at its 4th
    token, and that token: a rollout that stops on it generates exactly this first turn."""
    first = offline.offline[0][0]
    ids, stop = first["token_ids"][:4], first["token_ids"][3]
    assert stop not in ids[:3]
    return ids, first["logprobs"][:4], stop


def check_rollout(tokens: list[int], prompt_length: int, log_probs: list[float], loss_mask: list[int],
                  offline: VLMServices) -> None:
    """The prompt is the rendered one (image tokens expanded); the first turn equals vLLM offline on
    the same image and sampling; an observation and a second turn followed."""
    prompt = expanded(chat_ids([0], "what is 2 + 3?"))
    assert prompt_length == len(prompt) and tokens[:prompt_length] == prompt
    ids, logprobs, _ = first_turn_stop(offline)
    assert tokens[prompt_length:prompt_length + 4] == ids
    assert log_probs[:4] == logprobs and loss_mask[:4] == [1] * 4
    assert 0 in loss_mask[4:] and 1 in loss_mask[4:]  # the observation (not trained on), then turn two


async def test_a_vlm_rollout_through_the_multiturn_driver(
        redis_server: RedisServer, vlm_services: VLMServices, tiny_llava: str) -> None:
    from transformers import AutoTokenizer

    from broker.rollouts.multiturn import MultiTurnConfig, run_multiturn
    from broker.rollouts.render import ServerRenderer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava)
    messages = [{"role": "user", "content": [{"type": "image", "image": image(0)},
                                             {"type": "text", "text": "what is 2 + 3?"}]}]
    prefix = f"t{uuid.uuid4().hex[:10]}"
    env = RetryEnv()
    async with worker_pool(redis_server.url, prefix) as pool, FleetClient(redis_server.url, prefix=prefix) as fleet, \
            ServerRenderer(vlm_services.server.url, VLM_MODEL) as renderer:
        await pool.add(VLLMHTTPEngine(VLLMHTTPConfig(base_url=vlm_services.server.url, model=VLM_MODEL)))
        _, _, stop = first_turn_stop(vlm_services)
        config = MultiTurnConfig(model=VLM_MODEL, max_turns=2, max_new_tokens=24, seed=1, stop_token_ids=(stop,))
        sample = await run_multiturn(fleet, env, messages, config, tokenizer=tokenizer, renderer=renderer)
    assert env.closes == 1 and sample.turns == 2, sample.metadata
    assert sample.multimodal_features is not None and len(sample.multimodal_features["mm_hashes"]["image"]) == 1
    check_rollout(sample.tokens, sample.prompt_length, sample.rollout_log_probs, sample.loss_mask, vlm_services)


async def test_the_vime_adapter_rolls_out_a_prompt_with_an_image(
        redis_server: RedisServer, vlm_services: VLMServices, tiny_llava: str) -> None:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from broker.integrations import vime
    from tests.test_vime_adapter import Sample

    _, _, stop = first_turn_stop(vlm_services)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    args = SimpleNamespace(fleet_redis_url=redis_server.url, fleet_prefix=prefix, fleet_model=VLM_MODEL,
                           fleet_tokenizer=AutoTokenizer.from_pretrained(tiny_llava),
                           fleet_render_url=vlm_services.server.url, fleet_render_model=VLM_MODEL,
                           rollout_interaction_env_path=__name__, max_turns=2, rollout_max_context_len=None,
                           partial_rollout=False, apply_chat_template_kwargs=None,
                           append_eos_token_after_stop_str_in_multi_turn=True, use_rollout_routing_replay=False)
    sampling = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 1,
                "stop_token_ids": [stop]}
    sample = Sample(prompt="<image>what is 2 + 3?", multimodal_inputs={"images": [image(0)]})
    async with worker_pool(redis_server.url, prefix) as pool:
        await pool.add(VLLMHTTPEngine(VLLMHTTPConfig(base_url=vlm_services.server.url, model=VLM_MODEL)))
        try:
            await vime.generate(args, sample, sampling)
        finally:
            await vime.close_fleets()
    assert sample.status is Sample.Status.COMPLETED, sample.metadata
    assert sample.loss_mask is not None and sample.rollout_log_probs is not None
    check_rollout(sample.tokens, len(sample.tokens) - sample.response_length, sample.rollout_log_probs,
                  sample.loss_mask, vlm_services)
    pixels = sample.multimodal_train_inputs["pixel_values"]  # the processor's output, for the trainer
    assert tuple(pixels.shape) == (1, 3, 32, 32)
