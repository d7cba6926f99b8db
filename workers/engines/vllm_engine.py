"""vLLM in process: token-in/token-out generation on vLLM's async engine (``AsyncLLM``).

Token sessions (the per-session context of token ids, transactional steps, the output of a step)
work as ``token_sessions`` describes; vLLM's prefix cache finds the earlier turns' KV blocks, so
only the new tokens are prefilled. ``routed_experts`` come back when the step asks and the engine
was started with ``enable_return_routed_experts``.

An aborting weight update aborts the running requests through vLLM (``abort_running``); each
returns what it generated so far, which a ``continue`` update keeps (``workers.executor.Continuation``).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError, TransientEngineError
from schemas.messages import Mode, SamplingParams, TokenStep
from workers.engines.base import EngineRequest
from workers.engines.mm_features import merge_features
from workers.engines.partial import PartialAbort
from workers.engines.token_sessions import (
    DEFAULT_SEED,
    Generation,
    Result,
    TokenSessionEngine,
    run_token_batch,
    sampling_fields,
)

log = logging.getLogger(__name__)




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
    batches_in_flight: int = 4  # the server batches continuously: see Engine.batches_in_flight
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


class VLLMEngine(TokenSessionEngine):
    """Serves one model in ``tokens`` mode on an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    kind = "vllm"
    config_type = VLLMEngineConfig

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        super().__init__()
        self._ids = itertools.count()
        self._requests: set[str] = set()  # vLLM request ids of the generations running now
        self._aborted: set[str] = set()  # ... and of those abort_running stopped

    def models(self) -> Mapping[str, Mode]:
        return {self.config.name: Mode.TOKENS}

    def max_batch_size(self, model: str) -> int:
        return self.config.max_batch_size

    def batches_in_flight(self, model: str) -> int:
        return self.config.batches_in_flight

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
        if (refused := self.refuse_unknown_model(model, requests)) is not None:
            return refused
        if self._llm is None:
            await self.start()
        return await run_token_batch(requests, self._contexts, self._generate)

    async def _generate(self, prompt: list[int], step: TokenStep, request: EngineRequest) -> Generation:
        llm = self._llm
        if llm is None:
            raise RuntimeError("the vLLM engine is closed")
        params = vllm_sampling_params(step.sampling, self.config.default_seed)
        parts = self._features.for_step(request, step, len(prompt))
        engine_input = prompt_input(prompt, merge_features(parts))
        request_id = f"{request.session_key}-{next(self._ids)}"
        self._requests.add(request_id)
        try:
            # abort_session (a cancel) cancels the call, which makes vLLM abort the request.
            final = await self._calls.run(final_output(llm, engine_input, params, request_id), request.session_key)
        finally:
            self._requests.discard(request_id)
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for {request_id}")
        generation = completion_generation(final.outputs[0], step.sampling.logprobs)
        if aborted and generation.finish_reason == "abort":  # a finished one keeps its output
            raise PartialAbort("aborted for a weight update", generation.token_ids, generation.logprobs)
        self._features.commit(request, parts)
        return generation

    async def abort_running(self) -> bool:
        """Abort the running requests through vLLM's own abort: each one's final output (finish
        reason "abort") still comes back, with the tokens generated so far, and its step raises
        ``PartialAbort`` with them (a partial rollout continues from them). Contexts stay as they were."""
        # All of them each time: the gate calls this again while steps are inside it, and one whose
        # request vLLM had not registered yet (an abort of an unknown id does nothing) is caught then.
        running = sorted(self._requests)
        if running and self._llm is not None:
            self._aborted.update(running)
            await self._llm.abort(running)
        return True


def vllm_sampling_params(sampling: SamplingParams, default_seed: int) -> Any:
    """Our sampling params as vLLM's (final output only; token ids without text unless stop
    strings are asked for: vLLM matches them on its own detokenized output)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    try:
        return VllmSamplingParams(**sampling_fields(sampling, default_seed),
                                  output_kind=RequestOutputKind.FINAL_ONLY,
                                  detokenize=bool(sampling.stop))
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"sampling: {exc}") from exc


async def final_output(llm: Any, engine_input: Any, params: Any, request_id: str) -> Any:
    """The last output of one generation on ``llm`` (None if there was none), vLLM's errors mapped
    to ours: rejected input -> ``InvalidRequestError``, admission control -> ``TransientEngineError``."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError

    started = False
    last = None
    try:
        async for out in llm.generate(engine_input, params, request_id):
            started = True
            last = out
    except GracefulHTTPError as exc:  # admission control (queue full, ...): try again later
        raise graceful_http_error(exc) from exc
    except VLLMClientError as exc:  # rejected input: prompt too long, token id out of vocabulary, ...
        raise InvalidRequestError(str(exc)) from exc
    except (ValueError, TypeError) as exc:
        if not started:  # raised while vLLM checked the input, before any output
            raise InvalidRequestError(str(exc)) from exc
        raise
    return last


def graceful_http_error(exc: Any) -> Exception:
    """A ``vllm.exceptions.GracefulHTTPError`` as ours: 5xx, 408 and 429 are worth retrying."""
    status = int(exc.http_status)
    if status >= 500 or status in (408, 429):
        return TransientEngineError(f"vLLM: {exc.message}")
    return InvalidRequestError(exc.message)


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


def completion_generation(completion: Any, top_k: int = 0) -> Generation:
    """A ``vllm.outputs.CompletionOutput`` as a Generation: with ``top_k`` > 0 (the params asked
    ``logprobs=top_k``) each position's k most likely tokens too, and vLLM's ``stop_reason``."""
    ids = [int(t) for t in completion.token_ids]
    entries = list(completion.logprobs or [])
    logprobs: list[float] = []
    for token, entry in zip(ids, entries, strict=False):
        logprobs.append(float(entry[token].logprob))
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
    experts = getattr(completion, "routed_experts", None)
    stop = completion.stop_reason
    return Generation(token_ids=ids, logprobs=logprobs, finish_reason=str(completion.finish_reason or "abort"),
                      routed_experts=None if experts is None else np.asarray(experts),
                      top_logprobs=[ranked_top(entry, top_k) for entry in entries[:len(ids)]] if top_k else None,
                      stop_reason=stop if isinstance(stop, (str, int)) else None)


def ranked_top(entry: Mapping[int, Any], k: int) -> list[list[Any]]:
    """One position's ``{token_id: Logprob}`` (the sampled token and the top ``k``, each with its
    rank) as the ``k`` most likely ``[token_id, logprob]`` pairs in rank order. The sampled token
    is among them only when its rank is within ``k`` (vLLM adds it to the dict whatever its rank)."""
    ranked = sorted((int(lp.rank), int(token), float(lp.logprob)) for token, lp in entry.items()
                    if lp.rank is not None and lp.rank <= k)
    return [[token, logprob] for _, token, logprob in ranked]
