"""Chat prompts with images, rendered by a vLLM server: token ids plus the multimodal ``features``
that travel with the first step of a session (``Session.step(..., multimodal=features)``).

A vision-language prompt cannot be tokenized on the trainer alone: the image becomes as many
placeholder tokens as the model's processor decides, and the engine needs the processed image.
vLLM's ``POST /v1/chat/completions/render`` does both with the model's own chat template and
processor; both vLLM engines of the fleet take its ``features`` as they are.

    async with ServerRenderer("http://vllm:8000", "policy") as renderer:
        prompt = await renderer.render([{"role": "user", "content": [
            {"type": "image", "image": pixels}, {"type": "text", "text": "what is shown?"}]}])

Image parts may be ``{"type": "image", "image": X}`` with X an HxWx3 uint8 array, a PIL image, a
file path, a ``data:`` URL or an ``http(s)`` URL, or already ``{"type": "image_url", ...}``.
Needs ``httpx`` (and Pillow for arrays and PIL images): ``pip install rollout-fleet[render]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.chat import has_images, image_url, messages_for_render
from schemas.errors import RenderError

# The message helpers live in schemas.chat (the vLLM HTTP engine uses them too); they stay
# importable from here, where trainers found them first.
__all__ = ["ChatRenderer", "RenderError", "RenderedPrompt", "ServerRenderer", "has_images", "image_url",
           "messages_for_render"]


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    features: dict[str, Any] | None  # None for a text-only prompt


class ChatRenderer(Protocol):
    async def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> RenderedPrompt: ...


class ServerRenderer:
    """Renders through one vLLM server (``base_url``) serving ``model``."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 60.0) -> None:
        import httpx

        self.model = model
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)

    async def __aenter__(self) -> ServerRenderer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     add_generation_prompt: bool = True) -> RenderedPrompt:
        import httpx

        body: dict[str, Any] = {"model": self.model, "messages": messages_for_render(messages),
                                "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            body["tools"] = list(tools)
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        try:
            response = await self._http.post("/v1/chat/completions/render", json=body)
        except httpx.HTTPError as exc:
            raise RenderError(f"render: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 300:
            raise RenderError(f"render: HTTP {response.status_code}: {response.text[:500]}")
        answer = response.json()
        ids = answer.get("token_ids") if isinstance(answer, Mapping) else None
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise RenderError("render: the server answered without token_ids")
        features = answer.get("features")
        return RenderedPrompt(list(ids), None if features is None else dict(features))
