"""broker.rollouts.render's message handling (the server side is tested in tests/engines/test_vllm_multimodal.py)
and the multi-turn driver's refusal of images without a renderer."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from broker import FleetClient
from broker.rollouts.multiturn import run_multiturn
from broker.rollouts.render import has_images, image_url, messages_for_render
from schemas.errors import RenderError
from tests.test_multiturn import MathEnv


def decode(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def test_image_urls_keep_the_pixels_and_pass_urls_through(tmp_path: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    assert np.array_equal(decode(image_url(pixels)), pixels)
    assert np.array_equal(decode(image_url(Image.fromarray(pixels))), pixels)
    path = tmp_path / "cup.png"
    Image.fromarray(pixels).save(path)
    assert np.array_equal(decode(image_url(str(path))), pixels)
    for url in ("data:image/png;base64,AAAA", "https://example.org/cup.png"):
        assert image_url(url) == url
    with pytest.raises(RenderError, match="HxWx3 uint8"):
        image_url(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(RenderError, match="neither a URL nor a file"):
        image_url(str(tmp_path / "missing.png"))


def test_messages_for_render_turn_image_parts_into_image_urls() -> None:
    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image", "image": pixels}, {"type": "text", "text": "what?"}]}]
    out = messages_for_render(messages)
    assert out[0] == messages[0]
    assert out[1]["content"][0]["type"] == "image_url"
    assert np.array_equal(decode(out[1]["content"][0]["image_url"]["url"]), pixels)
    assert out[1]["content"][1] == {"type": "text", "text": "what?"}
    assert has_images(messages) and has_images(out) and not has_images(messages[:1])


async def test_a_prompt_with_images_needs_a_renderer(fleet: FleetClient) -> None:
    env = MathEnv()
    messages = [{"role": "user", "content": [{"type": "image", "image": "https://example.org/a.png"},
                                             {"type": "text", "text": "2 + 2?"}]}]
    with pytest.raises(ValueError, match="renderer"):
        await run_multiturn(fleet, env, messages)
    assert env.closes == 1  # the environment is still closed
