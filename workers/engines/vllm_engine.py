"""vLLM in process: token-in/token-out generation on vLLM's async engine (``AsyncLLM``).

Each token session's context is the list of token ids this worker keeps for it (prompt turns and
generated tokens, in order). A step appends its ``token_ids`` and generates from the whole context;
vLLM's prefix cache finds the earlier turns' KV blocks, so only the new tokens are prefilled. The
context changes only when a step succeeds (transactional); reset, close and ``drop_session`` forget
it; a stateless step starts from an empty context and keeps nothing.

Output of a step: ``token_ids`` (list[int]), ``logprobs`` (list[float], the sampled tokens' log
probabilities), ``finish_reason`` ("stop" | "length" | "abort") and ``routed_experts`` (ndarray
``(tokens - 1, layers, top_k)``, when the step asks and the engine was started with
``enable_return_routed_experts``). Randomness comes from the step's seed, else ``default_seed``.

Multimodal: a step's ``multimodal`` is the ``features`` object of ``/v1/chat/completions/render``
(see ``mm_features``); the engine input carries every turn's items, built as vLLM's
token-in/token-out server builds them.

A batch is submitted to the async engine all at once (vLLM batches them itself). vLLM is imported
when the engine starts, never at module import.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError, TransientEngineError
from schemas.messages import Mode, SamplingParams, TokenStep
from workers.engines.base import AbortableCalls, Engine, EngineOutput, EngineRequest, run_in_waves
from workers.engines.mm_features import SessionFeatures, merge_features

log = logging.getLogger(__name__)
Result = EngineOutput | BaseException

DEFAULT_SEED = 0


# --------------------------------------------------------------------------- shared with vllm_http


@dataclass(frozen=True)
class Generation:
    """One finished generation, engine independent."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: np.ndarray | None = None


def token_step(request: EngineRequest) -> TokenStep:
    if not isinstance(request.step, TokenStep):
        raise InvalidRequestError(f"vLLM engines take token steps, got {type(request.step).__name__}")
    return request.step


def sampling_fields(sampling: SamplingParams, default_seed: int) -> dict[str, Any]:
    """Our sampling params as vLLM ``SamplingParams`` keyword arguments (also its JSON form).

    ``logprobs=0``: the log probability of each sampled token only. ``top_k <= 0`` disables top-k
    (vLLM: 0). The seed is always set, so results never depend on the engine's global RNG.
    """
    return {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(0, sampling.top_k),
        "seed": default_seed if sampling.seed is None else sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
    }


def generation_output(gen: Generation, want_experts: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": list(gen.token_ids), "logprobs": list(gen.logprobs),
                           "finish_reason": gen.finish_reason}
    if want_experts and gen.routed_experts is not None:
        out["routed_experts"] = np.ascontiguousarray(gen.routed_experts)
    return out


class TokenContexts:
    """Per-session token contexts kept on the worker: the whole conversation as token ids."""

    def __init__(self) -> None:
        self._contexts: dict[str, list[int]] = {}

    def prompt_for(self, request: EngineRequest, step: TokenStep) -> list[int]:
        """The prompt of a step: its session's context (empty when fresh) plus the step's ids."""
        fresh = request.reset or request.stateless
        base = [] if fresh else self._contexts.get(request.session_key, [])
        prompt = [*base, *step.token_ids]
        if not prompt:
            raise InvalidRequestError("token_ids is empty and the session has no context to continue")
        return prompt

    def commit(self, request: EngineRequest, prompt: list[int], generated: Sequence[int]) -> int:
        """Store the context after a successful step; returns its length."""
        context = [*prompt, *generated]
        if not request.stateless:
            self._contexts[request.session_key] = context
        return len(context)

    def drop(self, session_key: str) -> None:
        self._contexts.pop(session_key, None)

    def clear(self) -> None:
        self._contexts.clear()

    def keys(self) -> list[str]:
        return sorted(self._contexts)

    def get(self, session_key: str) -> list[int] | None:
        ctx = self._contexts.get(session_key)
        return None if ctx is None else list(ctx)


async def run_token_batch(
    requests: Sequence[EngineRequest], contexts: TokenContexts,
    generate: Callable[[list[int], TokenStep, EngineRequest], Awaitable[Generation]],
) -> list[Result]:
    """Run a batch: every session's step concurrently (waves keep one session's steps in order)."""

    async def one(request: EngineRequest) -> EngineOutput:
        step = token_step(request)
        prompt = contexts.prompt_for(request, step)
        if step.sampling.max_tokens == 0:  # nothing to generate: the turn only extends the context
            gen = Generation(token_ids=[], logprobs=[], finish_reason="length")
        else:
            gen = await generate(prompt, step, request)
        length = contexts.commit(request, prompt, gen.token_ids)
        return EngineOutput(output=generation_output(gen, step.return_routed_experts), context_length=length)

    return await run_in_waves(requests, one)


class TokenSessionEngine(Engine):
    """What both vLLM engines keep per session on the worker: the token context, the multimodal
    features of its turns, and the running generation calls an aborting weight update cancels."""

    def __init__(self) -> None:
        self._contexts = TokenContexts()
        self._features = SessionFeatures()
        self._calls = AbortableCalls()

    async def abort_running(self) -> bool:
        """Cancel the running generations (vLLM aborts their requests); contexts stay as they were."""
        self._calls.abort_all()
        return True

    def drop_session(self, session_key: str) -> None:
        self._contexts.drop(session_key)
        self._features.drop(session_key)

    def session_keys(self) -> list[str]:
        return self._contexts.keys()

    def context(self, session_key: str) -> list[int] | None:
        """A copy of a session's context (for tests and diagnostics)."""
        return self._contexts.get(session_key)


# --------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class VLLMEngineConfig:
    """``model``: a local checkpoint directory (or a name vLLM can resolve). ``served_model_name``:
    the model name sessions ask for (default: the directory's name). ``engine_args``: any further
    ``vllm.AsyncEngineArgs`` fields (e.g. ``gpu_memory_utilization``, ``tensor_parallel_size``).
    ``env``: environment variables set before vLLM starts (e.g. ``VLLM_CPU_KVCACHE_SPACE``)."""

    model: str
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_return_routed_experts: bool = False
    seed: int = 0
    default_seed: int = DEFAULT_SEED
    max_batch_size: int = 64
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


class VLLMEngine(TokenSessionEngine):
    """Serves one model in ``tokens`` mode on an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    kind = "vllm"

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        super().__init__()
        self._ids = itertools.count()
        self._version = 0

    def models(self) -> Mapping[str, Mode]:
        return {self.config.name: Mode.TOKENS}

    def max_batch_size(self, model: str) -> int:
        return self.config.max_batch_size

    async def start(self) -> None:
        if self._llm is not None:
            return
        for key, value in self.config.env.items():
            os.environ.setdefault(key, str(value))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        args = AsyncEngineArgs(
            model=cfg.model, served_model_name=[cfg.name], dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            enable_return_routed_experts=cfg.enable_return_routed_experts, seed=cfg.seed,
            **dict(cfg.engine_args),
        )
        self._llm = AsyncLLM.from_engine_args(args)

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        self._contexts.clear()
        if llm is not None:
            llm.shutdown()

    @property
    def policy_version(self) -> int:
        return self._version

    async def load_weights(self, path: str, version: int) -> None:
        """vLLM's own reload: each engine worker reloads the checkpoint at ``path`` in place, then the
        prefix cache is reset so no KV computed with the old weights is reused. Session contexts are
        token ids, so they stay valid. The fleet worker calls this only between steps."""
        if self._llm is None:
            await self.start()
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        await self._llm.reset_prefix_cache()
        self._version = version

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[Result]:
        if model != self.config.name:
            return [InvalidRequestError(f"unknown model {model!r}; this engine serves {self.config.name!r}")
                    for _ in requests]
        if self._llm is None:
            await self.start()
        return await run_token_batch(requests, self._contexts, self._generate)

    async def _generate(self, prompt: list[int], step: TokenStep, request: EngineRequest) -> Generation:
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VllmSamplingParams

        llm = self._llm
        if llm is None:
            raise RuntimeError("the vLLM engine is closed")
        try:
            params = VllmSamplingParams(**sampling_fields(step.sampling, self.config.default_seed),
                                        output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"sampling: {exc}") from exc
        from vllm.exceptions import GracefulHTTPError, VLLMClientError

        parts = self._features.for_step(request, step, len(prompt))
        engine_input = prompt_input(prompt, merge_features(parts))
        request_id = f"{request.session_key}-{next(self._ids)}"
        final = None
        started = False

        async def consume() -> Any:
            nonlocal started
            last = None
            async for out in llm.generate(engine_input, params, request_id):
                started = True
                last = out
            return last

        try:
            # Cancelling the generation (abort_running) makes vLLM abort the request.
            final = await self._calls.run(consume())
        except GracefulHTTPError as exc:  # admission control (queue full, ...): try again later
            if int(exc.http_status) >= 500 or int(exc.http_status) in (408, 429):
                raise TransientEngineError(f"vLLM: {exc.message}") from exc
            raise InvalidRequestError(exc.message) from exc
        except VLLMClientError as exc:  # rejected input: prompt too long, token id out of vocabulary, ...
            raise InvalidRequestError(str(exc)) from exc
        except (ValueError, TypeError) as exc:
            if not started:
                raise InvalidRequestError(str(exc)) from exc
            raise
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for {request_id}")
        generation = completion_generation(final.outputs[0])
        self._features.commit(request, parts)
        return generation


def prompt_input(prompt: list[int], features: Mapping[str, Any] | None) -> Any:
    """The engine input of a prompt: token ids, plus the multimodal items of ``features`` (the
    ``/render`` format, session offsets) built the way vLLM's token-in/token-out server builds them."""
    if features is None:
        return {"prompt_token_ids": prompt}
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import MultiModalFeatures
    from vllm.inputs import mm_input
    from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

    try:
        parsed = MultiModalFeatures.model_validate(dict(features))
        mm_kwargs = mm_kwargs_from_features(parsed)
    except (ValidationError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"multimodal: {exc}") from exc
    placeholders = {modality: [PlaceholderRange(offset=p.offset, length=p.length) for p in ranges]
                    for modality, ranges in parsed.mm_placeholders.items()}
    for ranges in placeholders.values():
        if any(r.offset < 0 or r.offset + r.length > len(prompt) for r in ranges):
            raise InvalidRequestError("multimodal: a placeholder lies outside the prompt")
    return mm_input(prompt_token_ids=prompt, mm_kwargs=MultiModalKwargsItems(mm_kwargs),
                    mm_hashes=parsed.mm_hashes, mm_placeholders=placeholders)


def completion_generation(completion: Any) -> Generation:
    """A ``vllm.outputs.CompletionOutput`` (with ``logprobs=0``) as a Generation."""
    ids = [int(t) for t in completion.token_ids]
    logprobs: list[float] = []
    for token, entry in zip(ids, completion.logprobs or [], strict=False):
        logprobs.append(float(entry[token].logprob))
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    experts = getattr(completion, "routed_experts", None)
    return Generation(token_ids=ids, logprobs=logprobs, finish_reason=str(completion.finish_reason or "abort"),
                      routed_experts=None if experts is None else np.asarray(experts))
