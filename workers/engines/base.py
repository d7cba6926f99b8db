"""The engine interface: what a worker needs from anything that executes steps.

Engines are the only place that imports torch / vllm / vllm_omni, always lazily.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from schemas.errors import InvalidRequestError, StepAborted
from schemas.messages import Mode, StepInput
from schemas.records import quick_init


@quick_init
@dataclass(frozen=True)
class EngineRequest:
    """One step for the engine.

    ``session_key`` names the engine-side context. ``reset`` asks the engine to start that context
    fresh before running (first step after create/reset). ``stateless`` runs from a fresh context
    and keeps nothing afterwards (``use_session_context=False``).
    """

    session_key: str
    model: str
    step: StepInput
    reset: bool = False
    stateless: bool = False


@quick_init
@dataclass(frozen=True)
class EngineOutput:
    """What the engine produced: ``output`` goes to the trainer as is (ndarrays allowed)."""

    output: Mapping[str, Any]
    context_length: int


@dataclass(frozen=True)
class EngineLoad:
    """What an engine knows of its own load; None where it does not know (the worker then counts
    its running steps itself). Placement adds these to a worker's session share."""

    running_steps: int | None = None  # requests inside the engine now
    memory_use: float | None = None  # KV cache or accelerator memory in use, 0..1


T = TypeVar("T")


class AbortableCalls:
    """Engine calls (a remote request, a generation) that an abort can cancel: each runs as a task;
    ``abort_all`` cancels the ones running and each of those raises ``StepAborted`` to its caller.
    The engine must keep a session's context untouched until its call has returned."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()
        self._aborted: dict[asyncio.Task[Any], str] = {}  # task -> why it was aborted
        self._keys: dict[asyncio.Task[Any], str] = {}  # task -> its session key (abort_key)

    async def run(self, call: Awaitable[T], key: str | None = None) -> T:
        task = asyncio.ensure_future(call)
        self._running.add(task)
        if key is not None:
            self._keys[task] = key
        try:
            return await task
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if task in self._aborted and (caller is None or not caller.cancelling()):
                raise StepAborted(self._aborted[task]) from None
            raise  # the caller itself is being cancelled
        finally:
            self._running.discard(task)
            self._aborted.pop(task, None)
            self._keys.pop(task, None)

    def running(self) -> int:
        """How many calls are running now (the engine's running steps, for placement)."""
        return sum(1 for task in self._running if not task.done())

    def abort_all(self) -> int:
        """Cancel every running call; how many there were."""
        return self._abort([task for task in self._running if not task.done()], "aborted for a weight update")

    def abort_key(self, key: str) -> int:
        """Cancel the running calls of one session (``Session.cancel``); how many there were."""
        return self._abort([t for t, k in self._keys.items() if k == key and not t.done()], "aborted: cancelled")

    def _abort(self, live: list[asyncio.Task[Any]], why: str) -> int:
        for task in live:
            self._aborted[task] = why
            task.cancel()
        return len(live)


class Engine(abc.ABC):
    """Executes batches of steps. Implementations must be:

    - transactional per request: a request that raises leaves its session's context unchanged;
    - batch-invariant: a request's output does not depend on what else is in the batch;
    - deterministic: randomness comes from the request's seed or a fixed default only.
    """

    kind: str = "abstract"
    # The config dataclass ``--engine-opt`` options fill (see ``from_options``); None: the options
    # are the constructor's keyword arguments.
    config_type: ClassVar[Callable[..., Any] | None] = None
    # The weight version that produces results now: 0 until ``load_weights`` records a new one.
    _version: int = 0
    # Engines whose models have weights of their own (load_model_weights) keep each model's
    # version here; None: one set of weights, ``_version`` for every model.
    _model_versions: dict[str, int] | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Engine:
        """The engine built from ``--engine-opt KEY=VALUE`` options: ``cls(config_type(**options))``,
        or ``cls(**options)`` for an engine without a config type. A missing or unknown option
        raises ``TypeError``."""
        build: Callable[..., Engine] = cls  # the subclass's constructor: its signature is its own
        if cls.config_type is None:
            return build(**options)
        return build(cls.config_type(**options))

    @abc.abstractmethod
    def models(self) -> Mapping[str, Mode]:
        """The models this engine serves and the mode of each."""

    def refuse_unknown_model(self, model: str,
                             requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException] | None:
        """``run_batch``'s answer for a model this engine does not serve (an ``InvalidRequestError``
        per request: the worker never retries those); None when it serves ``model``."""
        served = self.models()
        if model in served:
            return None
        names = ", ".join(repr(name) for name in served)
        return [InvalidRequestError(f"unknown model {model!r}; this engine serves {names}") for _ in requests]

    async def start(self) -> None:
        """Load weights, warm up. Called once before the first batch."""

    async def close(self) -> None:
        """Free everything. Called once on shutdown."""

    async def ready(self) -> bool:
        """Whether the engine can run steps now (an engine in front of a server: the server answers
        its health check). False, or an exception whose message says why, means not ready: the
        worker then takes no new sessions. The worker bounds the call; keep it short."""
        return True

    @abc.abstractmethod
    async def run_batch(
        self, model: str, requests: Sequence[EngineRequest]
    ) -> list[EngineOutput | BaseException]:
        """Run one batch of one model; one output or exception per request, in order.

        Raise (or return) ``schemas.errors.InvalidRequestError`` for input that can never succeed;
        any other exception counts as a (possibly transient) inference error.
        """

    @abc.abstractmethod
    def drop_session(self, session_key: str) -> None:
        """Forget a session's context (reset/close/handover). Unknown keys are ignored. Runs on the
        worker's event loop: it must return at once, never wait for a running batch."""

    def export_session(self, session_key: str) -> bytes | None:
        """The session's context as bytes, for a snapshot another worker can import; None when the
        engine cannot export it (the context is then rebuilt by replay). Runs on the event loop
        right after a committed step, while no step of this session runs: it must be quick."""
        return None

    def import_session(self, session_key: str, model: str, data: bytes) -> bool:
        """Make ``data`` (from ``export_session`` of an engine like this one) the session's context;
        False when the engine cannot, or ``data`` is not a context of ``model`` (nothing changes)."""
        return False

    def max_batch_size(self, model: str) -> int:
        return 32

    def batches_in_flight(self, model: str) -> int:
        """Batches of ``model`` the worker may hand over at once. 1 for an engine that runs a batch
        itself; more for one that only fans a batch out to a server batching on its own (vLLM's
        continuous batching), so that a step that finished early does not wait for its batch."""
        return 1

    def load(self) -> EngineLoad:
        """The engine's load signals, read once per heartbeat on the event loop: cheap, no I/O."""
        return EngineLoad()

    def capacity_split(self, capacity: int) -> Mapping[str, int]:
        """Per-model caps within the worker's ``capacity`` (sessions over all its models), for an
        engine whose models share memory unevenly; a model left out is bounded by ``capacity``
        alone. Default: no split."""
        return {}

    @property
    def policy_version(self) -> int:
        """The weight version that produces results now."""
        return self._version

    def policy_version_of(self, model: str) -> int:
        """The weight version that produces ``model``'s results now."""
        versions = self._model_versions
        # The property, not _version: an engine that delegates (a wrapper) overrides the property.
        return versions.get(model, 0) if versions is not None else self.policy_version

    def policy_versions(self) -> dict[str, int]:
        """Every served model's version (the worker publishes it in its registry entry)."""
        return {model: self.policy_version_of(model) for model in self.models()}

    def _record_model_version(self, model: str, version: int) -> None:
        """For engines with per-model weights: ``model`` now runs ``version`` (``policy_version``
        stays the highest, for readers of the engine-wide number)."""
        if self._model_versions is None:
            self._model_versions = {name: self._version for name in self.models()}
        self._model_versions[model] = version
        self._version = max(self._model_versions.values())

    async def load_weights(self, path: str, version: int) -> None:
        """Load weight ``version`` from ``path`` through the engine's own mechanism. The worker calls
        this only while no step of this engine is running."""
        raise NotImplementedError(f"the {self.kind} engine cannot load weights")

    async def load_model_weights(self, model: str, path: str, version: int) -> None:
        """Load ``model``'s weight ``version`` from ``path``, leaving the engine's other models as they
        are. Default: the engine has one set of weights for all its models (``load_weights``),
        which is right for an engine serving one model; engines with several models whose weights
        are separate override this."""
        await self.load_weights(path, version)

    async def abort_running(self) -> bool:
        """Stop the steps running now as soon as the engine can: each raises (or returns)
        ``StepAborted``. Steps that start after this call are not affected. Returns False when the
        engine cannot abort; a weight update then waits for its running steps to finish."""
        return False

    def abort_session(self, session_key: str) -> bool:
        """Stop the running step of one session (``Session.cancel``) as soon as the engine can: it
        raises ``StepAborted`` and leaves the context as it was; other sessions' steps go on. Runs
        on the worker's event loop: it must return at once. False: the engine cannot (the step then
        runs to its end and is refused at the commit)."""
        return False

    def fork_session(self, source_key: str, branch_keys: Sequence[str]) -> bool:
        """Give each branch a copy of ``source_key``'s context (``Session.fork``; prefix caching or
        shared immutable state make it cheap). Called on the event loop while no step of the source
        runs. False: the engine cannot copy (or holds no context for the source); each branch then
        rebuilds from its records on its first step."""
        return False


def session_waves(requests: Sequence[EngineRequest]) -> list[list[int]]:
    """Indices of a batch split so that each session key appears at most once per wave (a session's
    steps run in order; different sessions' steps of one wave run together)."""
    waves: list[list[int]] = []
    seen: dict[str, int] = {}
    for index, request in enumerate(requests):
        wave = seen.get(request.session_key, -1) + 1
        seen[request.session_key] = wave
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    return waves


async def run_in_waves(
    requests: Sequence[EngineRequest], run_one: Callable[[EngineRequest], Awaitable[EngineOutput]]
) -> list[EngineOutput | BaseException]:
    """Run each request with ``run_one``, wave by wave, the requests of a wave concurrently; an
    exception becomes that request's result."""
    results: list[EngineOutput | BaseException] = [RuntimeError("not run")] * len(requests)

    async def one(index: int) -> None:
        try:
            results[index] = await run_one(requests[index])
        except Exception as exc:
            results[index] = exc

    for wave in session_waves(requests):
        await asyncio.gather(*(one(i) for i in wave))
    return results
