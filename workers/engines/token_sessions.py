"""Token sessions on the worker: what both vLLM engines (in process and over HTTP) keep per session.

Each token session's context is the list of token ids this worker keeps for it (prompt turns and
generated tokens, in order). A step appends its ``token_ids`` and generates from the whole context;
the server's prefix cache finds the earlier turns' KV blocks, so only the new tokens are prefilled.
The context changes only when a step succeeds (transactional); reset, close and ``drop_session``
forget it; a stateless step starts from an empty context and keeps nothing.

Output of a step: ``token_ids`` (list[int]), ``logprobs`` (list[float], the sampled tokens' log
probabilities), ``finish_reason`` ("stop" | "length" | "abort"), ``top_logprobs`` (when
``sampling.logprobs`` k > 0: per token, the k most likely ``[token_id, logprob]`` pairs, most likely
first, the reference LM's layout), ``stop_reason`` (when a ``sampling.stop`` string ended the step:
that string; when one of ``sampling.stop_token_ids`` did: that id; absent for EOS and length, as
vLLM's ``stop_reason`` None) and ``routed_experts`` (ndarray ``(tokens - 1, layers, top_k)``, when
the step asks and the engine can return them). Randomness comes from the step's seed, else the
engine's ``default_seed``.

Nothing here imports vllm: the engines bring their own ``generate``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.errors import InvalidRequestError
from schemas.messages import SamplingParams, TokenStep
from workers.engines.base import AbortableCalls, Engine, EngineLoad, EngineOutput, EngineRequest, run_in_waves
from workers.engines.mm_features import SessionFeatures

Result = EngineOutput | BaseException
Generate = Callable[[list[int], TokenStep, EngineRequest], Awaitable["Generation"]]

DEFAULT_SEED = 0


@dataclass(frozen=True)
class Generation:
    """One finished generation, engine independent."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: np.ndarray | None = None
    top_logprobs: list[list[list[Any]]] | None = None  # per token, k [token_id, logprob] pairs
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the step


def token_step(request: EngineRequest) -> TokenStep:
    if not isinstance(request.step, TokenStep):
        raise InvalidRequestError(f"vLLM engines take token steps, got {type(request.step).__name__}")
    return request.step


def sampling_fields(sampling: SamplingParams, default_seed: int) -> dict[str, Any]:
    """Our sampling params as vLLM ``SamplingParams`` keyword arguments (also its JSON form).

    ``logprobs``: 0 (the log probability of each sampled token only) unless top-k log probs are
    asked for. ``top_k <= 0`` disables top-k (vLLM: 0). The seed is always set, so results never
    depend on the engine's global RNG. ``stop`` strings, the penalties and ``min_tokens`` go only
    when set, so a plain step's params are what they always were.
    """
    extra = {name: value for name, value, default in (
        ("stop", list(sampling.stop), []), ("presence_penalty", sampling.presence_penalty, 0.0),
        ("frequency_penalty", sampling.frequency_penalty, 0.0),
        ("repetition_penalty", sampling.repetition_penalty, 1.0), ("min_tokens", sampling.min_tokens, 0),
    ) if value != default}
    return {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(0, sampling.top_k),
        "seed": default_seed if sampling.seed is None else sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": sampling.logprobs,
        **extra,
    }


def generation_output(gen: Generation, want_experts: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": list(gen.token_ids), "logprobs": list(gen.logprobs),
                           "finish_reason": gen.finish_reason}
    if gen.top_logprobs is not None:
        out["top_logprobs"] = gen.top_logprobs
    if gen.stop_reason is not None:
        out["stop_reason"] = gen.stop_reason
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

    def copy(self, source_key: str, branch_keys: Sequence[str]) -> bool:
        """Each branch gets the source's context (a fork); False when the source has none."""
        ctx = self._contexts.get(source_key)
        if ctx is None:
            return False
        for key in branch_keys:
            self._contexts[key] = list(ctx)
        return True


async def run_token_batch(requests: Sequence[EngineRequest], contexts: TokenContexts,
                          generate: Generate) -> list[Result]:
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

    def load(self) -> EngineLoad:
        """Generations running now, counted where they start (no call into vLLM)."""
        return EngineLoad(running_steps=self._calls.running())

    async def abort_running(self) -> bool:
        """Cancel the running generations (vLLM aborts their requests); contexts stay as they were."""
        self._calls.abort_all()
        return True

    def abort_session(self, session_key: str) -> bool:
        """Cancel the session's running generation (vLLM aborts the request); its context stays."""
        self._calls.abort_key(session_key)
        return True

    def fork_session(self, source_key: str, branch_keys: Sequence[str]) -> bool:
        """Branches get the source's token context and features; vLLM's prefix cache shares the KV."""
        if not self._contexts.copy(source_key, branch_keys):
            return False
        self._features.copy(source_key, branch_keys)
        return True

    def drop_session(self, session_key: str) -> None:
        self._contexts.drop(session_key)
        self._features.drop(session_key)

    def session_keys(self) -> list[str]:
        return self._contexts.keys()

    def context(self, session_key: str) -> list[int] | None:
        """A copy of a session's context (for tests and diagnostics)."""
        return self._contexts.get(session_key)
