"""An engine that does (almost) nothing: for tests of the fleet itself and for benchmarks.

Each output's ``context`` is the session's context before the step, so the outputs tell whether
the fleet delivered every step, once, in order: a world-model session's context counts the steps
it has run, a token session's the tokens it holds, as a real engine's does (each step's input ids
and the ids it generated: the input echoed, nothing where ``max_tokens`` is 0). A token context
rebuilt by one prefill of the recorded ids (workers/rebuild.py) so holds what the committed step
left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from schemas.errors import InvalidRequestError, StepAborted
from schemas.messages import Mode, TokenStep, WorldStep
from workers.engines.base import Engine, EngineLoad, EngineOutput, EngineRequest


@dataclass(frozen=True)
class NullEngineConfig:
    latent_shape: tuple[int, ...] = (1, 4)
    delay_ms: float = 0.0  # simulated compute per batch
    fail_prompt: str = "fail"  # a world step with this prompt raises a (transient-looking) error


class NullEngine(Engine):
    kind = "null"
    config_type = NullEngineConfig

    def __init__(self, config: NullEngineConfig | None = None) -> None:
        self.config = config or NullEngineConfig()
        self._contexts: dict[str, int] = {}  # steps (world model) or tokens (token session) per session
        self.batch_sizes: list[int] = []
        self._aborted = asyncio.Event()  # set (and replaced) by abort_running
        self._running = 0  # requests inside run_batch now (the load signal)

    def models(self) -> Mapping[str, Mode]:
        return {"null-world": Mode.WORLD_MODEL_ENV, "null-lm": Mode.TOKENS}

    def load(self) -> EngineLoad:
        return EngineLoad(running_steps=self._running)

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        self.batch_sizes.append(len(requests))
        self._running += len(requests)
        try:
            return await self._run(requests)
        finally:
            self._running -= len(requests)

    async def _run(self, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        if self.config.delay_ms:
            aborted = self._aborted
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                async with asyncio.timeout(self.config.delay_ms / 1000.0):
                    await aborted.wait()
            if aborted.is_set():
                return [StepAborted("aborted during its simulated compute") for _ in requests]
        return [self._one(req) for req in requests]

    async def abort_running(self) -> bool:
        """Batches in their simulated compute stop now; later ones are not affected."""
        aborted, self._aborted = self._aborted, asyncio.Event()
        aborted.set()
        return True

    def _one(self, req: EngineRequest) -> EngineOutput | BaseException:
        step = req.step
        seen = 0 if (req.reset or req.stateless) else self._contexts.get(req.session_key, 0)
        if isinstance(step, WorldStep):
            if step.observation.prompt == self.config.fail_prompt:
                return RuntimeError("null engine was asked to fail")
            if step.observation.prompt == "invalid":
                return InvalidRequestError("null engine rejects the prompt 'invalid'")
            latent = np.full(self.config.latent_shape, float(seen), dtype=np.float32)
            output: dict[str, object] = {"video_latent": latent, "context": seen}
            length = seen + 1
        elif isinstance(step, TokenStep):
            generated = list(step.token_ids) if step.sampling.max_tokens else []
            output = {"token_ids": generated, "logprobs": [0.0] * len(generated), "finish_reason": "length",
                      "context": seen}
            length = seen + len(step.token_ids) + len(generated)
        else:  # pragma: no cover - schemas only build these two
            return InvalidRequestError(f"unsupported step {type(step).__name__}")
        if not req.stateless:
            self._contexts[req.session_key] = length
        return EngineOutput(output=output, context_length=length)

    async def load_weights(self, path: str, version: int) -> None:
        """The null engine has no weights; an update only changes the reported version."""
        for model in self.models():
            self._record_model_version(model, version)

    async def load_model_weights(self, model: str, path: str, version: int) -> None:
        """Per model: an update of one model leaves the other's version as it is."""
        self._record_model_version(model, version)

    def drop_session(self, session_key: str) -> None:
        self._contexts.pop(session_key, None)
