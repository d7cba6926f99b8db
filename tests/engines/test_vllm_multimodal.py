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
from broker.embedded import RedisServer
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
