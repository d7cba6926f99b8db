"""The reference engine: two small deterministic torch models that run anywhere on CPU.

- ``reference-world`` (Mode.WORLD_MODEL_ENV): ``ReferenceWorldModel``; output ``{"video_latent": float32
  ndarray of config.latent_shape}``, context length = steps in the session.
- ``reference-lm`` (Mode.TOKENS): ``ReferenceLanguageModel``; output ``{"token_ids", "logprobs",
  "finish_reason"}`` plus ``"routed_experts"`` (int16, (rows, layers, top_k)) when requested,
  ``"top_logprobs"`` (per token, ``sampling.logprobs`` ``[id, logprob]`` pairs) when asked for and
  ``"stop_reason"`` (the stop string) when a ``sampling.stop`` string ended the step;
  context length = tokens in the session.

Results are deterministic and bitwise batch invariant on CPU (see ``torch_ops``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from schemas.codec import decode, encode
from schemas.errors import FleetError, StepAborted
from schemas.messages import Mode
from workers.engines.base import Engine, EngineOutput, EngineRequest, session_waves
from workers.engines.reference_lm import STOPPED, LMJob, LMSessionState, ReferenceLanguageModel, ReferenceLMConfig
from workers.engines.reference_world import (
    ReferenceWorldConfig,
    ReferenceWorldModel,
)
from workers.engines.weights import check_state, copy_state, tensors

WORLD_MODEL = "reference-world"
LM_MODEL = "reference-lm"
Result = EngineOutput | BaseException
_P = TypeVar("_P")
_NOT_RUN = RuntimeError("reference engine: request was not run")  # placeholder, always replaced


@dataclass(frozen=True)
class ReferenceEngineConfig:
    """``seed`` fixes both models' weights. ``threads`` is torch's intra-op thread count: 1 keeps
    every reduction in one thread, so results stay bitwise batch invariant."""

    seed: int = 0
    latent_shape: tuple[int, ...] = (1, 16, 2, 44, 80)
    device: str = "cpu"
    threads: int = 1
    lm: ReferenceLMConfig = field(default_factory=ReferenceLMConfig)
    max_batch_size: int = 32

    def __post_init__(self) -> None:
        # Options may come from YAML / CLI: accept a list for the shape and a mapping for ``lm``.
        object.__setattr__(self, "latent_shape", tuple(int(d) for d in self.latent_shape))
        if isinstance(self.lm, Mapping):
            lm_options: Mapping[str, Any] = self.lm
            object.__setattr__(self, "lm", ReferenceLMConfig(**lm_options))
        if self.threads < 1 or self.max_batch_size < 1:
            raise ValueError("threads and max_batch_size must be >= 1")


@dataclass(frozen=True)
class WorldSessionState:
    hidden: torch.Tensor
    steps: int


class ReferenceEngine(Engine):
    """Serves ``reference-world`` and ``reference-lm`` with per-session contexts."""

    kind = "reference"
    config_type = ReferenceEngineConfig

    def __init__(self, config: ReferenceEngineConfig | None = None) -> None:
        self.config = config or ReferenceEngineConfig()
        self._world: ReferenceWorldModel | None = None
        self._lm: ReferenceLanguageModel | None = None
        self._world_sessions: dict[str, WorldSessionState] = {}
        self._lm_sessions: dict[str, LMSessionState] = {}
        self._async_lock = asyncio.Lock()
        self._lock = threading.Lock()  # sessions and torch work: one batch at a time
        self._drops_lock = threading.Lock()
        self._drops: set[str] = set()  # sessions to forget before the next batch (see drop_session)
        self._aborts = 0  # bumped by abort_running; batches submitted before a bump stop
        # abort_session: session -> the number of its latest abort, out of one sequence; a batch
        # stops a session's step when that number is newer than the batch. Dropped with the session,
        # so a long-running worker does not keep one entry per session it ever cancelled.
        self._abort_seq = 0
        self._session_aborts: dict[str, int] = {}

    def models(self) -> Mapping[str, Mode]:
        return {WORLD_MODEL: Mode.WORLD_MODEL_ENV, LM_MODEL: Mode.TOKENS}

    def max_batch_size(self, model: str) -> int:
        return self.config.max_batch_size

    async def start(self) -> None:
        await asyncio.to_thread(self._build)

    async def close(self) -> None:
        with self._lock:
            self._world_sessions.clear()
            self._lm_sessions.clear()
            self._world = None
            self._lm = None

    def _build(self) -> None:
        with self._lock:
            if self._world is not None and self._lm is not None:
                return
            # Single-threaded: a multi-threaded reduction splits its work by the total size, which
            # would make a row's bits depend on the batch. This is process wide, on purpose.
            torch.set_num_threads(self.config.threads)
            cfg = self.config
            self._world = ReferenceWorldModel(ReferenceWorldConfig(latent_shape=cfg.latent_shape),
                                              seed=cfg.seed, device=cfg.device)
            self._lm = ReferenceLanguageModel(cfg.lm, seed=cfg.seed, device=cfg.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._build()
        assert self._world is not None
        return {**{f"world.{k}": v for k, v in tensors(self._world).items()},
                **{f"lm.{k}": v for k, v in tensors(self._lm).items()},
                "world_seed": torch.tensor(self._world.seed, dtype=torch.int64)}

    def save_weights(self, path: str) -> None:
        torch.save(self.state_dict(), path)

    async def load_weights(self, path: str, version: int) -> None:
        """Reload both models' weights from a saved state dict (under the batch lock, so no batch
        ever runs on half-loaded weights)."""
        await self._load_models((WORLD_MODEL, LM_MODEL), path, version)

    async def load_model_weights(self, model: str, path: str, version: int) -> None:
        """Reload one model's part of a saved state dict; the other model keeps its weights and
        its version."""
        await self._load_models((model,), path, version)

    async def _load_models(self, models: tuple[str, ...], path: str, version: int) -> None:
        state = await asyncio.to_thread(torch.load, path, map_location="cpu", weights_only=True)
        async with self._async_lock:
            await asyncio.to_thread(self._load, state, models)
            for model in models:
                self._record_model_version(model, version)

    def _load(self, state: dict[str, torch.Tensor], models: tuple[str, ...]) -> None:
        self._build()
        assert self._world is not None and self._lm is not None
        parts: list[tuple[Any, dict[str, torch.Tensor]]] = []
        if WORLD_MODEL in models:
            if "world_seed" not in state:
                raise ValueError("weights file has no world_seed")
            parts.append((self._world, {k[len("world."):]: v for k, v in state.items() if k.startswith("world.")}))
        if LM_MODEL in models:
            parts.append((self._lm, {k[len("lm."):]: v for k, v in state.items() if k.startswith("lm.")}))
        with self._lock:
            for target, weights in parts:  # all checked before anything changes
                check_state(target, weights)
            for target, weights in parts:
                copy_state(target, weights)
            if WORLD_MODEL in models:
                self._world.reseed_projections(int(state["world_seed"]))

    def drop_session(self, session_key: str) -> None:
        """Called on the worker's event loop, so it never waits for a running batch (that would
        stall heartbeats and reads for the whole batch): the drop is queued and applied now if the
        engine is free, else before the next batch, i.e. after the running one, as if it had waited."""
        with self._drops_lock:
            self._drops.add(session_key)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_drops()
            finally:
                self._lock.release()

    def _apply_drops(self) -> None:
        """Forget the queued sessions; the caller holds ``_lock``."""
        with self._drops_lock:
            drops, self._drops = self._drops, set()
        for key in drops:
            self._world_sessions.pop(key, None)
            self._lm_sessions.pop(key, None)
            self._session_aborts.pop(key, None)

    def export_session(self, session_key: str) -> bytes | None:
        """A world session's hidden state and step count (a language-model session is rebuilt from
        its tokens in one prefill instead). States are replaced, never changed in place, so reading
        one without the batch lock is safe."""
        with self._drops_lock:
            if session_key in self._drops:
                return None
        state = self._world_sessions.get(session_key)
        if state is None:
            return None
        return encode({"model": WORLD_MODEL, "steps": state.steps, "hidden": state.hidden.cpu().numpy()})

    def import_session(self, session_key: str, model: str, data: bytes) -> bool:
        world = self._world
        if model != WORLD_MODEL or world is None:
            return False
        try:
            fields = decode(data)
            hidden = world.check_state(torch.from_numpy(np.array(fields["hidden"], dtype=np.float32)))
            steps = fields["steps"]
            if fields["model"] != WORLD_MODEL or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                return False
        except (FleetError, KeyError, TypeError, ValueError):
            return False
        with self._drops_lock:  # a drop queued before this import must not undo it
            self._drops.discard(session_key)
        self._world_sessions[session_key] = WorldSessionState(hidden=hidden, steps=steps)
        return True

    def session_keys(self) -> list[str]:
        """Keys of all stored contexts (for tests and diagnostics)."""
        with self._lock:
            self._apply_drops()
            return sorted({*self._world_sessions, *self._lm_sessions})

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[Result]:
        """Run a batch in a worker thread (one at a time) so the event loop stays free."""
        mark, since = self._aborts, self._abort_seq

        def aborted() -> bool:
            return self._aborts != mark

        def session_aborted(key: str) -> bool:  # a dropped session's forgotten mark is no abort
            return self._session_aborts.get(key, 0) > since

        async with self._async_lock:
            return await asyncio.to_thread(self.run_direct, model, requests, aborted, session_aborted)

    def abort_session(self, session_key: str) -> bool:
        """A language-model step of the session stops at its next decode step (a world step is one
        pass: it runs to its end)."""
        self._abort_seq += 1
        self._session_aborts[session_key] = self._abort_seq
        return True

    def fork_session(self, source_key: str, branch_keys: Sequence[str]) -> bool:
        """The branches share the source's state: session states are immutable (a step builds new
        tensors), so sharing is a copy. A single dict store each, safe beside a running batch."""
        with self._drops_lock:
            if source_key in self._drops:  # about to be forgotten: nothing true to copy
                return False
            self._drops.difference_update(branch_keys)
            for table in (self._world_sessions, self._lm_sessions):
                state: Any = table.get(source_key)
                if state is not None:
                    for key in branch_keys:
                        table[key] = state
                    return True
        return False

    async def abort_running(self) -> bool:
        """Batches submitted before this call stop at their next decode step (language model: each
        step still generating answers ``PartialAbort`` with its tokens so far, a finished one its
        result) or before their forward pass (world model, whose step is one pass)."""
        self._aborts += 1
        return True

    def run_direct(self, model: str, requests: Sequence[EngineRequest],
                   should_stop: Callable[[], bool] | None = None,
                   session_stopped: Callable[[str], bool] | None = None) -> list[Result]:
        """The synchronous core of ``run_batch``: also the direct call the fidelity tests use."""
        self._build()
        if (refused := self.refuse_unknown_model(model, requests)) is not None:
            return refused
        with self._lock:
            self._apply_drops()
            results: list[Result | None] = [None] * len(requests)
            # A session may appear more than once: run such batches in waves, in request order.
            for wave in session_waves(requests):
                batch = [requests[i] for i in wave]
                if should_stop is not None and should_stop():
                    outs: list[Result] = [StepAborted("aborted before it ran") for _ in batch]
                elif model == WORLD_MODEL:
                    outs = self._run_world(batch)
                else:
                    outs = self._run_lm(batch, should_stop, session_stopped)
                for i, out in zip(wave, outs, strict=True):
                    results[i] = out
            return [_NOT_RUN if r is None else r for r in results]

    # ------------------------------------------------------------------ world model

    def _run_world(self, requests: Sequence[EngineRequest]) -> list[Result]:
        model = self._world
        assert model is not None
        prepared = _prepare(requests, lambda request: (self._world_state(request), model.prepare(request.step)))
        ready = [(i, item) for i, item in enumerate(prepared) if not isinstance(item, BaseException)]
        outputs = _guarded(lambda: model.forward([(s.hidden if s else None, p) for _, (s, p) in ready]),
                           len(ready))
        results: list[Result] = [p if isinstance(p, BaseException) else _NOT_RUN for p in prepared]
        for (i, (state, _)), out in zip(ready, outputs, strict=True):
            if isinstance(out, BaseException):
                results[i] = out
                continue
            latent, hidden = out
            request = requests[i]
            steps = (state.steps if state else 0) + 1
            if not request.stateless:
                self._world_sessions[request.session_key] = WorldSessionState(hidden=hidden, steps=steps)
            results[i] = EngineOutput(output={"video_latent": latent}, context_length=steps)
        return results

    def _world_state(self, request: EngineRequest) -> WorldSessionState | None:
        if request.reset or request.stateless:
            return None
        return self._world_sessions.get(request.session_key)

    # ------------------------------------------------------------------ language model

    def _run_lm(self, requests: Sequence[EngineRequest], should_stop: Callable[[], bool] | None,
                session_stopped: Callable[[str], bool] | None = None) -> list[Result]:
        model = self._lm
        assert model is not None
        prepared = _prepare(requests, lambda request: model.prepare(self._lm_state(request), request.step))
        ready = [(i, job) for i, job in enumerate(prepared) if isinstance(job, LMJob)]
        keys = {id(job): requests[i].session_key for i, job in ready}
        stop_job = None if session_stopped is None else (lambda job: session_stopped(keys[id(job)]))
        outputs = _guarded(lambda: model.run([job for _, job in ready], should_stop, stop_job), len(ready))
        results: list[Result] = [p if isinstance(p, BaseException) else _NOT_RUN for p in prepared]
        for (i, _), out in zip(ready, outputs, strict=True):
            if not isinstance(out, BaseException) and out.finish_reason == STOPPED:
                out = StepAborted("aborted: cancelled")  # its session keeps the context it had
            if isinstance(out, BaseException):
                results[i] = out
                continue
            request = requests[i]
            if not request.stateless:
                self._lm_sessions[request.session_key] = out.state
            results[i] = EngineOutput(output=out.output(), context_length=out.context_length)
        return results

    def _lm_state(self, request: EngineRequest) -> LMSessionState | None:
        if request.reset or request.stateless:
            return None
        return self._lm_sessions.get(request.session_key)


def _prepare(requests: Sequence[EngineRequest], fn: Callable[[EngineRequest], _P]) -> list[_P | BaseException]:
    """``fn`` per request; an error (InvalidRequestError for bad input) becomes that request's result."""
    out: list[_P | BaseException] = []
    for request in requests:
        try:
            out.append(fn(request))
        except Exception as exc:
            out.append(exc)
    return out


def _guarded(fn: Callable[[], Sequence[Any]], count: int) -> list[Any]:
    """Run the batched forward; if it fails unexpectedly, every request in it gets the error."""
    if count == 0:
        return []
    try:
        return list(fn())
    except Exception as exc:
        return [exc] * count
