"""vLLM over HTTP: a worker that fronts one running vLLM server's token-in/token-out API.

The server runs with ``--enable-scale-out`` (``python -m vllm.entrypoints.openai.api_server --model
DIR --enable-scale-out ...``). A step POSTs ``/inference/v1/generate`` with the session's whole
context as ``token_ids`` (the context is kept here, per session, as in the in-process engine; the
server's prefix cache makes the repeated prefix cheap), the sampling params and ``logprobs=0``
(``k + 1`` when the step asks for its top ``k``: see ``top_from_content``).
``render_chat`` turns chat messages into token ids (and multimodal features) with
``/v1/chat/completions/render``, for trainers that start from messages.

Multimodal: a step's ``multimodal`` is the ``features`` object of ``/render`` for that step's
``token_ids`` (placeholder offsets relative to them). The engine shifts the offsets by the
session's context length and sends the features of every earlier turn along, so the server sees
one consistent prompt.

Weights: ``load_weights`` uses the server's development routes, so the server runs with
``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=wait``, ``/collective_rpc`` (``reload_weights`` with
``weights_path``: vLLM's own in-place reload), ``/reset_prefix_cache`` (no KV of the old weights is
reused), ``/update_weight_version``, ``/resume``; at start ``/weight_info`` tells which policy
version the server already has. Without dev mode steps work and a weight update reports why it
cannot be done. ``abort_running`` cancels this worker's generate calls (the server aborts requests
whose client went away). One worker fronts a server.

Stop reason: the server's answer has none, so it is found here as vLLM finds it: a step that ends
on one of ``sampling.stop_token_ids`` names that id (vLLM names none when that id is also the
model's EOS, which this engine does not know); else, when ``sampling.stop`` strings were
asked for, the string the last token completes in the output text (``POST /detokenize`` of the
output with and without its last token; only for steps that end with "stop"). The server's
detokenize keeps the text of special tokens, which vLLM's own output text skips: a stop string found
only in a special token's text is named where vLLM's ``stop_reason`` is None.

Errors: HTTP 4xx (except 408/429) -> ``InvalidRequestError`` (never retried); 5xx, 408, 429,
timeouts and connection errors -> ``TransientEngineError`` (the worker retries those; generation is
deterministic under the step's seed, so a retry after a lost response gives the same result).
"""

from __future__ import annotations

import base64
import io
import itertools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np

from schemas.chat import messages_for_render
from schemas.errors import TransientEngineError
from schemas.messages import Mode, SamplingParams, TokenStep
from workers.engines.base import EngineRequest
from workers.engines.http_common import ServerEngine, post_json
from workers.engines.mm_features import merge_features
from workers.engines.token_sessions import (
    DEFAULT_SEED,
    Generation,
    Result,
    TokenSessionEngine,
    run_token_batch,
    sampling_fields,
)

__all__ = ["VLLMHTTPConfig", "VLLMHTTPEngine"]


@dataclass(frozen=True)
class VLLMHTTPConfig:
    """``base_url``: the vLLM server (``http://host:port``). ``model``: the fleet's model name;
    ``server_model``: the server's served model name (default: ``model``)."""

    base_url: str
    model: str
    server_model: str | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_connections: int = 64
    default_seed: int = DEFAULT_SEED
    max_batch_size: int = 64
    batches_in_flight: int = 4  # the server batches continuously: see Engine.batches_in_flight


def http_sampling(sampling: SamplingParams, default_seed: int) -> dict[str, Any]:
    """The ``sampling_params`` of a generate request: one more log prob than the step's top k (see
    ``top_from_content``); the default 0 (the sampled token's only) when it asks for none."""
    fields = sampling_fields(sampling, default_seed)
    if sampling.logprobs:
        fields["logprobs"] = sampling.logprobs + 1
    return fields


def decode_npy_b64(data: str) -> np.ndarray:
    array = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    return np.asarray(array)


def generation_from_choice(choice: Mapping[str, Any], top_k: int = 0) -> Generation:
    """One ``choices[]`` entry of ``/inference/v1/generate`` as a Generation (the request asked for
    ``top_k + 1`` log probs per position when ``top_k`` > 0)."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(ids):
        raise TransientEngineError(f"server returned {len(logprobs)} logprobs for {len(ids)} tokens")
    experts = choice.get("routed_experts")
    return Generation(token_ids=ids, logprobs=logprobs, finish_reason=str(choice.get("finish_reason") or "abort"),
                      routed_experts=None if experts is None else decode_npy_b64(experts),
                      top_logprobs=[top_from_content(e, k=top_k) for e in content] if top_k else None)


def top_from_content(entry: Mapping[str, Any], k: int) -> list[list[Any]]:
    """One position's ``top_logprobs`` from the server as the ``k`` most likely ``[token_id,
    logprob]`` pairs. The server lists the first ``logprobs`` entries of vLLM's per-position dict:
    the sampled token first (whatever its rank), then the top tokens in rank order. Asked for k + 1,
    that list always holds the top k: the sampled token goes back to its place by its log prob
    (after the tokens it does not beat, as vLLM ranks ties), then the first k are kept."""
    listed = [(_token_id(item["token"]), float(item["logprob"])) for item in entry.get("top_logprobs") or []]
    if not listed:
        raise TransientEngineError("generate: the server answered without top_logprobs")
    sampled, rest = listed[0], listed[1:]
    place = sum(1 for _, logprob in rest if logprob >= sampled[1])
    ranked = [*rest[:place], sampled, *rest[place:]]
    return [[token, logprob] for token, logprob in ranked[:k]]


def _token_id(token: Any) -> int:
    """The server names tokens ``"token_id:<id>"`` in ``top_logprobs``."""
    text = str(token)
    if not text.startswith("token_id:"):
        raise TransientEngineError(f"generate: unexpected token name {text[:40]!r} in top_logprobs")
    return int(text.removeprefix("token_id:"))


def stop_string_at_end(full: str, before: str, stop: Sequence[str]) -> str | None:
    """The stop string the last token completed: ``full`` is the output text, ``before`` the text
    without the last token. As vLLM's ``check_stop_strings``: the one that completes earliest in
    the new characters, ties to the earlier in ``stop``."""
    new_chars = len(full) - len(before)
    best: tuple[int, str] | None = None
    for candidate in stop:
        if new_chars <= 0:
            break
        index = full.find(candidate, max(0, len(full) - new_chars - len(candidate) + 1))
        if index != -1 and (best is None or index + len(candidate) < best[0]):
            best = (index + len(candidate), candidate)
    return None if best is None else best[1]


# --------------------------------------------------------------------------- the engine


class VLLMHTTPEngine(TokenSessionEngine, ServerEngine):
    """Serves ``config.model`` (tokens) by calling one vLLM server."""

    kind = "vllm-http"
    config_type = VLLMHTTPConfig
    mode = Mode.TOKENS

    def __init__(self, config: VLLMHTTPConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        ServerEngine.__init__(self, config, transport)
        TokenSessionEngine.__init__(self)
        self.config = config
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    async def start(self) -> None:
        self._version = await self._server_version()

    async def _server_version(self) -> int:
        """The policy version the server already runs (a number set by an earlier update), else 0."""
        try:
            response = await self._http().get("/weight_info")
            value = response.json().get("weight_version") if response.status_code == 200 else None
            return int(value) if value is not None else 0
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return 0

    async def close(self) -> None:
        self._contexts.clear()
        await self._close_http()

    async def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any,
                          ) -> tuple[list[int], dict[str, Any] | None]:
        """Chat messages -> (token ids, multimodal ``features`` or None) by the server's chat template
        (image parts as in ``schemas.chat``).

        ``options`` go into the render request (e.g. ``add_generation_prompt``, ``chat_template_kwargs``).
        """
        body = {"model": self.server_model, "messages": messages_for_render(messages), **options}
        rendered = await post_json(self._http(), "/v1/chat/completions/render", body, "render")
        ids = [int(t) for t in rendered.get("token_ids") or []]
        features = rendered.get("features")
        return ids, None if features is None else dict(features)

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[Result]:
        if (refused := self.refuse_unknown_model(model, requests)) is not None:
            return refused
        return await run_token_batch(requests, self._contexts, self._generate)

    async def _generate(self, prompt: list[int], step: TokenStep, request: EngineRequest) -> Generation:
        parts = self._features.for_step(request, step, len(prompt))
        body: dict[str, Any] = {
            "model": self.server_model,
            "request_id": f"fleet-{self._prefix}-{next(self._ids)}",
            "token_ids": prompt,
            "sampling_params": http_sampling(step.sampling, self.config.default_seed),
            "stream": False,
        }
        features = merge_features(parts)
        if features is not None:
            body["features"] = features
        answer = await self._calls.run(post_json(self._http(), "/inference/v1/generate", body, "generate"),
                                       request.session_key)
        choices = answer.get("choices") if isinstance(answer, Mapping) else None
        if not choices:
            raise TransientEngineError("generate: the server answered without choices")
        gen = generation_from_choice(choices[0], step.sampling.logprobs)
        stop_reason = await self._stop_reason(gen, step.sampling)
        self._features.commit(request, parts)
        return replace(gen, stop_reason=stop_reason)

    async def _stop_reason(self, gen: Generation, sampling: SamplingParams) -> str | int | None:
        """What ended a "stop" step (see the module's docstring); None for EOS and length."""
        if gen.finish_reason != "stop" or not gen.token_ids:
            return None
        if gen.token_ids[-1] in sampling.stop_token_ids:
            return gen.token_ids[-1]
        if not sampling.stop:
            return None
        texts = [await self._detokenize(ids) for ids in (gen.token_ids, gen.token_ids[:-1])]
        return stop_string_at_end(texts[0], texts[1], sampling.stop)

    async def _detokenize(self, ids: list[int]) -> str:
        if not ids:
            return ""
        answer = await post_json(self._http(), "/detokenize", {"model": self.server_model, "tokens": ids},
                                 "detokenize")
        return str((answer or {}).get("prompt") or "")
