"""AReaL rollout workflows on the fleet: an inference engine with AReaL's ``agenerate`` signature.

AReaL (1.0.x) workflows call ``await engine.agenerate(ModelRequest) -> ModelResponse`` inside
``arun_episode(engine, data)``. :class:`FleetInferenceEngine` answers that call on the fleet:

- a request is a step of a fleet token session. A request whose ``input_ids`` extend the context of
  a conversation of the same episode (AReaL's multi-turn workflows send the whole history again,
  under a new ``rid`` each turn) continues that conversation's session and sends only the new
  tokens; any other request opens a new session with the whole prompt;
- ``output_versions`` are the fleet's per-token ``weight_versions`` (a step continued across a
  weight update mixes two versions), ``stop_reason`` is the step's ``finish_reason``,
  ``latency`` (= ``ttft``: the fleet does not stream tokens to the trainer) its round trip;
- ``gconfig.n_samples`` must be 1, as in AReaL's own engines; :meth:`agenerate_group` gives
  ``n_samples`` samples of one prompt that share its prefix on one worker (``Session.fork``);
- ``async with engine.episode():`` scopes conversations; :meth:`arollout_batch` runs each
  workflow episode in one and closes its sessions when the episode returns. Outside an episode
  conversations live until ``max_open_conversations`` evicts the oldest, :meth:`aclose`, or their
  worker closes them after ``idle_timeout_s``.

Staleness is the fleet's: ``max_staleness`` on every session and an ``Admission`` on every create
(docs/async_rl.md maps AReaL's ``max_head_offpolicyness`` onto them). The parts of AReaL's
``InferenceEngine`` that drive AReaL's own servers and executor (``submit``/``wait``,
``prepare_batch``, weight-update groups, server launch, pause/resume, offload) raise
:class:`UnsupportedByFleet`: the fleet has its own (``rollout-fleet update-weights``, admission,
drain). areal is imported only when a response is built, so this module imports without areal.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from redis.exceptions import RedisError

from broker.client import DEFAULT_URL, Admission, FleetClient
from broker.client.session import MAX_BRANCHES
from broker.integrations.areal_requests import (
    Conversation,
    ConversationIndex,
    Generated,
    fleet_sampling,
    generated,
)
from broker.integrations.vime import fleet_for
from schemas.errors import ErrorCode, FleetError, InvalidRequestError, StalePolicyError, error_for

DEFAULT_MODEL = "reference-lm"
DEFAULT_IDLE_TIMEOUT_S = 600.0
# Open conversations kept for continuation outside an episode (each holds a session on a worker).
DEFAULT_MAX_OPEN = 1024
# How long a create over the admission bound waits for the trainer's next version (AReaL's rollout
# loop waits for capacity without a bound; here every wait has one).
ADMISSION_WAIT_S = 600.0
# (engine, index) of the episode the running task belongs to; tasks an episode starts inherit it.
_EPISODE: contextvars.ContextVar[tuple[object, ConversationIndex] | None] = contextvars.ContextVar(
    "areal_fleet_episode", default=None)


class UnsupportedByFleet(InvalidRequestError, NotImplementedError):
    """A part of AReaL's InferenceEngine the fleet does not offer (``invalid_request``); it is also a
    NotImplementedError, which AReaL code probing optional methods catches."""


@dataclass(frozen=True)
class ArealFleetSettings:
    """Where and how the engine rolls out. ``admission`` counts every session it opens (one per
    conversation) against the producer's bound; ``max_staleness`` bounds each conversation."""

    redis_url: str = DEFAULT_URL
    prefix: str = "rf"
    cell: str = "0"
    model: str = DEFAULT_MODEL
    step_timeout: float | None = None
    max_staleness: int | None = None
    admission: Admission | None = None
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_open_conversations: int = DEFAULT_MAX_OPEN

    @classmethod
    def from_areal_config(cls, config: Any, name: str, *, group_size: int = 1, wait_s: float = ADMISSION_WAIT_S,
                          **fields: Any) -> ArealFleetSettings:
        """From AReaL's ``InferenceEngineConfig``: ``max_head_offpolicyness`` (η) and
        ``consumer_batch_size`` (B) become ``Admission(name, batch_size=B * group_size,
        max_offpolicyness=η, wait_s=wait_s)`` (admission counts sessions: one per episode of a
        group) and ``max_staleness=η``; ``request_timeout`` the step timeout. ``fields`` win."""
        eta = int(config.max_head_offpolicyness)
        batch = int(config.consumer_batch_size) * int(group_size)
        admission = Admission(name, batch_size=batch, max_offpolicyness=eta, wait_s=wait_s)
        derived: dict[str, Any] = {"admission": admission,
                                   "max_staleness": eta, "step_timeout": float(config.request_timeout)}
        return cls(**{**derived, **fields})


class FleetInferenceEngine:
    """AReaL's InferenceEngine (the parts its rollout workflows use) backed by fleet sessions."""

    def __init__(self, settings: ArealFleetSettings | None = None, *, fleet: FleetClient | None = None,
                 response_type: Callable[..., Any] | None = None) -> None:
        self.settings = settings or ArealFleetSettings()
        if self.settings.max_open_conversations < 1:
            raise InvalidRequestError("max_open_conversations must be at least 1")
        self._fleet = fleet
        self._response_type = response_type  # AReaL's ModelResponse unless given (tests without areal)
        self._shared = ConversationIndex()  # conversations started outside any episode
        self._version = 0
        self._initialized = False
        self._stats = {"requests": 0, "sessions_opened": 0, "continued": 0, "stale_dropped": 0}

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        """Mark the engine ready. The fleet connection opens on the event loop of the first request
        (a FleetClient belongs to one loop); AReaL's server addresses are not used."""
        self._initialized = True

    @property
    def initialized(self) -> bool:
        return self._initialized

    def destroy(self) -> None:
        """Mark the engine closed. Sessions are closed by :meth:`aclose` (on the loop that opened
        them); one left open is closed by its worker after ``idle_timeout_s``."""
        self._initialized = False

    async def aclose(self) -> None:
        """Close every conversation this engine opened outside an episode (the client it connected
        stays open for reuse: ``broker.integrations.vime.close_fleets()`` closes it at shutdown)."""
        await _close_all(self._shared.drain())

    async def fleet(self) -> FleetClient:
        if self._fleet is None:
            s = self.settings
            self._fleet = await fleet_for(s.redis_url, s.prefix, s.cell)
        return self._fleet

    # ------------------------------------------------------------------ versions and stats

    def set_version(self, version: int) -> None:
        """The trainer's weight version, as AReaL's trainer sets it after an update. Informational:
        ``output_versions`` come from the fleet (what each token ran on), and staleness compares
        against the version announced to the fleet (``rollout-fleet update-weights``)."""
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def export_stats(self) -> dict[str, float]:
        """Counts since the engine was made: requests, sessions opened, requests that continued an
        open conversation, episodes dropped for ``stale_policy``."""
        return {f"fleet/{key}": float(value) for key, value in self._stats.items()}

    def open_session_ids(self) -> list[str]:
        """The fleet sessions of the open conversations in scope (the running episode's, or those
        started outside any episode), oldest first."""
        return [c.session.session_id for c in self._index()]

    # ------------------------------------------------------------------ generation

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        """A scope for one workflow episode: its requests continue only its own conversations, and
        every session it opened is closed when it ends."""
        index = ConversationIndex()
        token = _EPISODE.set((self, index))
        try:
            yield
        finally:
            _EPISODE.reset(token)
            await _close_all(index.drain())

    async def agenerate(self, req: Any) -> Any:
        """One sample for AReaL's ``ModelRequest``: a ``ModelResponse``."""
        if int(req.gconfig.n_samples) != 1:
            raise InvalidRequestError(f"gconfig.n_samples = {req.gconfig.n_samples}: agenerate gives one sample "
                                      "(as AReaL's engines); use agenerate_group for a forked group")
        input_ids, sampling = self._prepare(req)
        index = self._index()
        conversation = await self._conversation(index, input_ids)
        started = time.perf_counter()
        gen = await self._step(index, conversation, input_ids, sampling)
        index.release(conversation)
        await self._bound(index)
        return self._response(req, input_ids, gen, time.perf_counter() - started)

    async def agenerate_group(self, req: Any) -> list[Any]:
        """``gconfig.n_samples`` samples of one prompt: the prompt (or its new tokens) runs once on
        a parent session with ``max_tokens=0``, ``Session.fork`` gives one branch per sample on the
        parent's worker, and each branch samples on its own. Every branch, and the parent (holding
        the prompt), stays open for continuation like any conversation."""
        n = int(req.gconfig.n_samples)
        if not 1 <= n <= MAX_BRANCHES:
            raise InvalidRequestError(f"gconfig.n_samples must be in [1, {MAX_BRANCHES}], got {n}")
        input_ids, sampling = self._prepare(req)
        index = self._index()
        parent = await self._conversation(index, input_ids)
        await self._step(index, parent, input_ids, {**sampling, "max_tokens": 0})
        try:
            sessions = await parent.session.fork(n)
        except FleetError:
            index.forget(parent)
            await _close_all([parent])
            raise
        index.release(parent)
        branches = [Conversation(s, list(parent.context), parent.next_step) for s in sessions]
        for branch in branches:
            index.add(branch)
        self._stats["sessions_opened"] += n
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(self._step(index, b, input_ids, sampling) for b in branches),
                                        return_exceptions=True)
        latency = time.perf_counter() - started
        for branch, outcome in zip(branches, outcomes, strict=True):
            if not isinstance(outcome, BaseException):  # a failed branch was closed by _step
                index.release(branch)
        await self._bound(index)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [self._response(req, input_ids, gen, latency) for gen in outcomes if isinstance(gen, Generated)]

    def _prepare(self, req: Any) -> tuple[list[int], dict[str, Any]]:
        if getattr(req, "image_data", None) or getattr(req, "vision_msg_vllm", None):
            raise InvalidRequestError("multimodal requests are not supported by the AReaL fleet adapter yet")
        input_ids = [int(t) for t in req.input_ids]
        if not input_ids:
            raise InvalidRequestError("input_ids is empty")
        self._stats["requests"] += 1
        return input_ids, fleet_sampling(req.gconfig, len(input_ids), getattr(req, "tokenizer", None))

    def _index(self) -> ConversationIndex:
        current = _EPISODE.get()
        return current[1] if current is not None and current[0] is self else self._shared

    async def _conversation(self, index: ConversationIndex, input_ids: Sequence[int]) -> Conversation:
        """The conversation ``input_ids`` continue (claimed), else a new session's."""
        conversation = index.claim(input_ids)
        if conversation is not None:
            self._stats["continued"] += 1
            return conversation
        s = self.settings
        session = await (await self.fleet()).create_session(
            s.model, "tokens", idle_timeout_s=s.idle_timeout_s, max_staleness=s.max_staleness, admission=s.admission)
        self._stats["sessions_opened"] += 1
        conversation = Conversation(session)
        index.add(conversation)
        return conversation

    async def _step(self, index: ConversationIndex, conversation: Conversation, input_ids: list[int],
                    sampling: dict[str, Any]) -> Generated:
        """Send the tokens the worker has not seen; the conversation's context becomes
        ``input_ids`` + the sample. A refused or failed step closes the conversation and raises its
        error (``stale_policy``: the trajectory is past its bound; drop the episode)."""
        new = input_ids[len(conversation.context):]
        result = await conversation.session.step(conversation.next_step, token_ids=new, sampling=sampling,
                                                 timeout=self.settings.step_timeout)
        if not result.ok:
            error = result.error
            await self._failed(index, conversation, error.code if error else ErrorCode.INFERENCE_ERROR,
                               error.message if error else "no result")
        try:
            gen = generated(result)
        except FleetError as exc:
            await self._failed(index, conversation, exc.code, exc.message)
        conversation.next_step += 1
        conversation.context = [*input_ids, *gen.tokens]
        return gen

    async def _failed(self, index: ConversationIndex, conversation: Conversation, code: ErrorCode,
                      message: str) -> NoReturn:
        index.forget(conversation)
        await _close_all([conversation])
        raise error_for(code, f"session {conversation.session.session_id}: {message}")

    async def _bound(self, index: ConversationIndex) -> None:
        """Close the least recently used conversations over ``max_open_conversations``."""
        while len(index) > self.settings.max_open_conversations:
            oldest = index.evict_oldest()
            if oldest is None:  # every one is in flight
                return
            await _close_all([oldest])

    def _response(self, req: Any, input_ids: list[int], gen: Generated, latency: float) -> Any:
        make = self._response_type or _areal_model_response()
        return make(input_tokens=list(input_ids), output_tokens=gen.tokens, output_logprobs=gen.logprobs,
                    output_versions=gen.versions, stop_reason=gen.stop_reason,
                    tokenizer=getattr(req, "tokenizer", None), latency=latency, ttft=latency, itl=[])

    # ------------------------------------------------------------------ batches of episodes

    async def arollout_batch(self, data: Sequence[dict[str, Any]], workflow: Any,
                             workflow_kwargs: dict[str, Any] | None = None, group_size: int = 1) -> list[Any]:
        """AReaL's ``rollout_batch`` on the running loop: ``workflow.arun_episode(self, item)`` for
        every item (``group_size`` times, concatenated by AReaL's GroupedRolloutWorkflow), each in
        its own :meth:`episode`; the trajectories in order. Rejected (None) ones are left out, and so
        are episodes a step of which answered ``stale_policy`` (counted in ``fleet/stale_dropped``)."""
        runner = _workflow(workflow, workflow_kwargs)
        if group_size != 1:
            from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
            from areal.utils import logging as areal_logging

            runner = GroupedRolloutWorkflow(runner, group_size, areal_logging.getLogger("FleetInferenceEngine"))

        async def one(item: dict[str, Any]) -> Any:
            async with self.episode():
                try:
                    return await runner.arun_episode(self, item)
                except StalePolicyError:  # past max_staleness: dropped, as AReaL drops a rejected one
                    self._stats["stale_dropped"] += 1
                    return None

        results = await asyncio.gather(*(one(item) for item in data))
        return [result for result in results if result is not None]

    def rollout_batch(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("rollout_batch", "await engine.arollout_batch(...) on the loop the fleet client runs on")

    def submit(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("submit", "arollout_batch, or the workflow's arun_episode in engine.episode()")

    def wait(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("wait", "arollout_batch")

    def wait_for_task(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("wait_for_task", "arollout_batch")

    def prepare_batch(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("prepare_batch", "arollout_batch with Admission(...) bounding off-policyness")

    @property
    def workflow_executor(self) -> NoReturn:
        _unsupported("workflow_executor", "arollout_batch")


def _unsupported_methods() -> dict[str, Any]:
    """AReaL InferenceEngine methods that drive AReaL's own servers: each raises UnsupportedByFleet."""
    instead = {
        "launch_server": "rollout-fleet worker processes", "teardown_server": "draining workers (SIGTERM)",
        "init_weights_update_group": "rollout-fleet update-weights",
        "update_weights_from_distributed": "rollout-fleet update-weights",
        "update_weights_from_disk": "rollout-fleet update-weights",
        "pause_generation": "update-weights (workers pause and resume themselves)",
        "continue_generation": "update-weights (workers pause and resume themselves)",
        "pause": "Admission(...) bounding trajectory starts", "resume": "Admission(...)",
        "offload": "worker placement", "onload": "worker placement",
        "compute_logp": "the log probs every step returns", "save_perf_tracer": "rollout-fleet status / metrics",
        "config_perf_tracer": "rollout-fleet status / metrics",
    }

    def method(name: str, use: str) -> Any:
        def raise_unsupported(self: FleetInferenceEngine, *args: Any, **kwargs: Any) -> NoReturn:
            _unsupported(name, use)

        raise_unsupported.__name__ = name
        return raise_unsupported

    return {name: method(name, use) for name, use in instead.items()}


for _name, _method in _unsupported_methods().items():
    setattr(FleetInferenceEngine, _name, _method)


def _unsupported(name: str, instead: str) -> NoReturn:
    raise UnsupportedByFleet(f"InferenceEngine.{name} is not offered by the fleet adapter; use {instead}")


def _workflow(workflow: Any, kwargs: dict[str, Any] | None) -> Any:
    """An AReaL RolloutWorkflow from an instance, a class, or an import path ("pkg.mod.Class")."""
    if isinstance(workflow, str):
        import importlib

        module, _, name = workflow.rpartition(".")
        workflow = getattr(importlib.import_module(module), name)
    if isinstance(workflow, type):
        return workflow(**(kwargs or {}))
    if not hasattr(workflow, "arun_episode"):
        raise InvalidRequestError(f"{workflow!r} has no arun_episode: not an AReaL RolloutWorkflow")
    return workflow


def _areal_model_response() -> Callable[..., Any]:
    from areal.api.io_struct import ModelResponse

    return ModelResponse  # type: ignore[no-any-return]


async def _close_all(conversations: Iterable[Conversation]) -> None:
    """Close sessions; a close that fails (Redis gone, already closed) leaves the session to its
    worker's idle timeout and does not hide the caller's own outcome."""
    for conversation in conversations:
        with contextlib.suppress(FleetError, RedisError, OSError):
            await conversation.session.close()
