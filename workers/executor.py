"""Runs one job end to end: decode, engine (with retries), then commit through Lua.

What a step passes on the way is here too: the cancel marks it is checked against, the staleness
checks (before it runs and after the weight gate) and, for a token step that spans weight updates,
its continuation (partial rollouts). Kept apart from the worker loop so the exactly-once rules live
in one place. Every way a step can fail raises ``StepFailed``; the worker answers it with
:meth:`StepExecutor.publish_failure`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio import Redis

from broker.redis.backoff import REDIS_ERRORS, until_redis_answers
from broker.redis.inbox import BadEntry, InboxEntry, JobKind
from broker.redis.inputs import InputGone, dead_letter_input, read_input
from broker.redis.keys import CellKeys
from broker.redis.script_replies import CancelledCommit, Committed, Duplicate, OutOfOrder
from broker.redis.scripts import Scripts
from schemas.codec import decode, encode
from schemas.errors import (
    ContextLost,
    ErrorCode,
    FleetError,
    InvalidRequestError,
    StepAborted,
    TransientEngineError,
)
from schemas.messages import Latency, StepInput, StepResult, TokenStep, parse_step_input
from workers.batcher import Batcher
from workers.engines.base import Engine, EngineOutput, EngineRequest
from workers.engines.partial import partial_of
from workers.job_scripts import (
    CommitAnswer,
    JobScripts,
    ReplicaConfirmation,
    StepFailed,
    finish_before_cancel,
    settled,
    settled_in_place,
)
from workers.rebuild import VERSIONS_KEY, Snapshotter, output_digest, rebuild_context, records_kept, step_record
from workers.settings import WorkerSettings
from workers.weight_control import InGate, VersionWaitEnded, WeightGate
from workers.worker_metrics import StepStats, WorkerMetrics

log = logging.getLogger(__name__)
EngineRun = tuple[EngineOutput, int, float, int]  # output, attempt, engine ms, policy version


@dataclass
class SessionState:
    """What this worker knows of a session it owns, at one lease epoch."""

    committed: int
    epoch: int
    engine_ready: bool = False  # the engine holds the context of every committed step
    model: str = ""  # the session's model (the sessions gauge counts by model)
    max_staleness: int | None = None  # the session's staleness bound (StalenessCheck)
    checked_version: int = 0  # the engine's version at the last staleness check


# ------------------------------------------------------------------ cancels
# What this worker knows of its sessions' cancels (``Session.cancel``): the cancel count of the
# last cancel entry read per session. A step enqueued under a lower count is answered ``cancelled``
# without running. Bounded: a session forgotten here only loses that shortcut, as commit.lua refuses
# a cancelled step's commit on its own.

MAX_CANCELLED_SESSIONS = 100_000  # the newest cancels kept; one small int per cancelled session


class CancelMarks:
    """The newest cancel count read per session (bounded)."""

    def __init__(self, max_sessions: int = MAX_CANCELLED_SESSIONS) -> None:
        self._marks: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max = max_sessions

    def record(self, session_id: str, cancels: int) -> None:
        """A cancel entry (or a commit refused as cancelled) says the session's count is ``cancels``."""
        self._marks[session_id] = max(self._marks.pop(session_id, 0), cancels)
        while len(self._marks) > self._max:
            self._marks.popitem(last=False)

    def cancelled(self, session_id: str, cancels: int) -> bool:
        """Whether a step enqueued under ``cancels`` was cancelled since."""
        return cancels < self._marks.get(session_id, 0)


# ------------------------------------------------------------------ staleness
# The worker's half of ``max_staleness`` (docs/async_rl.md). enqueue.lua refuses a step once
# the version announced for the session's model passed the trajectory's first version by more than
# the bound; a step queued before that announcement is refused here, when its lane picks it up,
# and again after the weight gate when the worker's weights changed while it waited there (the
# update that made it stale). A refused step commits nothing and falls back like a failed step:
# the trainer drops or resets the trajectory.


def stale_message(first: int, announced: int, model: str, max_staleness: int) -> str | None:
    """Why a step of a trajectory that started on ``first`` is stale, or None (enqueue.lua says
    the same)."""
    if announced <= first + max_staleness:
        return None
    return (f"the trajectory started on policy version {first} and version {announced} of {model} is "
            f"announced, more than max_staleness {max_staleness} ahead: drop the trajectory or reset the session")


class StalenessCheck:
    """Reads the trajectory's first version and the announced one (one round trip) for the steps
    of sessions with a bound; sessions without one cost nothing."""

    def __init__(self, redis: Redis, keys: CellKeys, engine: Engine) -> None:
        self.redis = redis
        self.keys = keys
        self.engine = engine

    async def before_run(self, job: InboxEntry, max_staleness: int | None) -> int:
        """Refuse a stale step (StepFailed ``stale_policy``); the engine's version it checked at."""
        version = self.engine.policy_version_of(job.model)
        if max_staleness is not None:
            await self._check(job, max_staleness)
        return version

    async def in_gate(self, job: InboxEntry, max_staleness: int | None, checked: int, version: int) -> None:
        """After the gate: check again only when the weights changed since ``checked``."""
        if max_staleness is not None and version != checked:
            await self._check(job, max_staleness)

    async def _check(self, job: InboxEntry, max_staleness: int) -> None:
        async def read() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hget(self.keys.session(job.session_id), "first_version")
                pipe.hget(self.keys.announced, job.model)
                return await pipe.execute()

        first, announced = await until_redis_answers(read, f"staleness {job.session_id}")
        if first is None:  # the trajectory has no committed step yet: this one starts it
            return
        why = stale_message(int(first), int(announced or 0), job.model, max_staleness)
        if why is not None:
            raise StepFailed(ErrorCode.STALE_POLICY, why, fallback=True)


# ------------------------------------------------------------------ partial rollouts
# Partial rollouts: a token step that spans weight updates, and the version of each of its tokens.
#
# A weight update with ``in_flight="continue"`` aborts the running steps like ``abort`` does, but a
# token step keeps what it generated before the abort (``PartialAbort``): after the update it runs
# again with those tokens appended to its prompt and its ``max_tokens`` (and ``min_tokens``) reduced by their count, so
# the generation continues on the new weights from where it stopped (vLLM's prefix cache finds the
# context; only the kept tokens are prefilled). The result carries every token and log probability
# of the step, and ``weight_versions``: the policy version of each generated token, e.g.
# ``[3, 3, 3, 4, 4]`` (vime's ``Sample.weight_versions``, per token). Every token step reports it,
# all entries equal when the step ran on one version. The engine's context after the step is the
# step's prompt plus all its tokens, exactly as for a step that was never aborted.
#
# World-model steps have no partial output: under ``continue`` they run again, whole, as under
# ``abort``. So does a token step the engine stopped without telling what it had generated.


class Continuation:
    """One step's runs across aborting weight updates: the tokens kept so far and their versions."""

    def __init__(self, request: EngineRequest) -> None:
        self.original = request
        self.request = request  # what the engine runs next
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    @property
    def kept(self) -> int:
        return len(self.token_ids)

    def aborted(self, exc: BaseException, version: int, *, keep: bool) -> int:
        """The step was aborted while it ran on ``version``. ``keep``: continue from what it
        generated (a ``continue`` update), else run it again, whole (an ``abort`` update; tokens
        kept by an earlier ``continue`` go too). Returns how many tokens are kept now."""
        step = self.original.step
        token_ids, logprobs = partial_of(exc)
        if not keep or not isinstance(step, TokenStep):
            self.request, self.token_ids, self.logprobs, self.versions = self.original, [], [], []
            return 0
        if not token_ids:
            return self.kept
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        # Both budgets count the step's tokens: the kept ones are generated already.
        sampling = replace(step.sampling, max_tokens=max(0, step.sampling.max_tokens - self.kept),
                           min_tokens=max(0, step.sampling.min_tokens - self.kept))
        self.request = replace(self.original, step=replace(step, token_ids=(*step.token_ids, *self.token_ids),
                                                         sampling=sampling))
        return self.kept

    def output(self, out: EngineOutput, version: int) -> EngineOutput:
        """The step's output from the last run's (on ``version``): the kept tokens first, and the
        version of every token (token steps only; other outputs pass as they are)."""
        if not isinstance(self.original.step, TokenStep) or "token_ids" not in out.output:
            return out
        merged: dict[str, Any] = dict(out.output)
        generated = [int(t) for t in out.output["token_ids"]]
        merged["token_ids"] = [*self.token_ids, *generated]
        if "logprobs" in out.output:
            merged["logprobs"] = [*self.logprobs, *(float(p) for p in out.output["logprobs"])]
        merged[VERSIONS_KEY] = [*self.versions, *([version] * len(generated))]
        return EngineOutput(output=merged, context_length=out.context_length)


class StepExecutor:
    def __init__(self, settings: WorkerSettings, scripts: Scripts, engine: Engine,
                 batchers: dict[str, Batcher], gate: WeightGate, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else WorkerMetrics(None, batchers)
        self.gate = gate
        self.scripts = scripts
        self.jobs = JobScripts(scripts, settings)
        self.replicas = ReplicaConfirmation(self.jobs, settings)
        self.engine = engine
        self.staleness = StalenessCheck(scripts.redis, scripts.keys, engine)
        self.batchers = batchers
        self.committed_steps = 0
        self.failed_steps = 0
        self.stats = StepStats(settings.heartbeat_ms)  # the dashboard's rates and latencies
        self.rebuilt_steps = 0
        self.aborted_steps = 0  # runs stopped by an aborting weight update (each ran again)
        self.rebuild_engine_calls = 0  # engine requests rebuilds made (one per token session)
        self.replayed_steps = 0  # steps rebuilds ran one by one (after a snapshot: at most N)
        self.snapshots = Snapshotter(scripts, engine, settings.snapshot_every)
        self.draining = False  # a drain stops every step waiting at the gate for a policy version
        self._gate_waits: dict[str, set[asyncio.Event]] = {}  # session -> its steps' stop events
        self.cancels = CancelMarks()  # the sessions' cancels read here (workers/fork_cancel.py)

    @property
    def worker_id(self) -> str:
        return self.jobs.worker_id

    @worker_id.setter
    def worker_id(self, worker_id: str) -> None:
        self.jobs.worker_id = worker_id

    # ------------------------------------------------------------------ publishing

    async def publish(self, job: InboxEntry, result: StepResult, *, fallback: bool,
                      dead_letter: dict[str, object] | None = None) -> None:
        """Publish a result that commits nothing; ``fallback`` lets the trainer retry the step."""
        payload = encode(result.to_wire())
        await settled(lambda: self.jobs.report(job, payload, fallback=fallback, dead_letter=dead_letter),
                      f"report {job.session_id}/{job.step_id}")

    async def publish_failure(self, job: InboxEntry | BadEntry, failure: StepFailed,
                              state: SessionState | None) -> None:
        """Answer a failed job: its error result, the fallback and the dead letter it asks for."""
        if isinstance(job, BadEntry):  # one attempt, as its pipeline is not safe to repeat
            await finish_before_cancel(self.jobs.reject_malformed(job, failure))
            self.metrics.fleet.dead_letters.inc()
            return
        self.failed_steps += 1
        if job.kind == JobKind.STEP:
            self.metrics.failed(job.model, failure.code.value, dead_letter=failure.dead_letter)
        self.stats.failed()
        result = StepResult.failure(
            job.session_id, job.step_id, failure.code, failure.message,
            committed_step_id=state.committed if state else -1, worker_id=self.worker_id,
            attempt=failure.attempt, policy_version=self.engine.policy_version_of(job.model),
        )
        fields = None
        if failure.dead_letter:
            kept = await self._staged_dead_letter_input(job) if job.input_staged else None
            fields = job.dead_letter_fields(f"{failure.code.value}: {failure.message}", failure.attempt,
                                            self.worker_id, int(time.time() * 1000), kept)
        await self.publish(job, result, fallback=failure.fallback, dead_letter=fields)

    async def _staged_dead_letter_input(self, job: InboxEntry) -> tuple[bytes, str]:
        """What the dead letter of a job with a staged payload keeps of it (a replay needs it)."""
        try:
            return await dead_letter_input(self.scripts.redis, self.scripts.keys, job.session_id, job.job_id)
        except REDIS_ERRORS as exc:
            return b"", f"its staged payload could not be read: {exc}"

    # ------------------------------------------------------------------ steps

    async def run_step(self, job: InboxEntry, state: SessionState | None) -> None:
        """A contextual step (``state`` given) or a stateless one (``state`` None)."""
        picked_ms = time.time() * 1000.0
        if state is not None and job.step_id > state.committed:
            self._raise_if_cancelled(job)  # before the order check: the steps after it are cancelled too
        if state is not None and not await self._is_next(job, state):
            return
        request = EngineRequest(
            session_key=job.session_id if state is not None else f"{job.session_id}:stateless",
            model=job.model, step=await self._parse(job), reset=state is not None and state.committed == -1,
            stateless=state is None,
        )
        out, attempt, engine_ms, version = await self._run_gated(job, request, state)
        result = StepResult(
            session_id=job.session_id, step_id=job.step_id, ok=True,
            committed_step_id=job.step_id if state is not None else (-1),
            output=out.output, context_length=out.context_length,
            latency=Latency(queue_ms=max(0.0, picked_ms - job.enqueued_ms), engine_ms=engine_ms),
            worker_id=self.worker_id, attempt=attempt, policy_version=version,
        )
        if state is None:
            await self.publish(job, result, fallback=False)
            return
        commit_started = time.perf_counter()
        if await self._commit(job, result, state):
            self.metrics.committed(job.model, queue_ms=result.latency.queue_ms, engine_ms=engine_ms,
                                   commit_s=time.perf_counter() - commit_started, enqueued_ms=job.enqueued_ms)
            if self.snapshots.due(job):
                await self.snapshots.after_commit(job, output_digest(out.output), self.worker_id)

    async def _parse(self, job: InboxEntry) -> StepInput:
        payload = job.payload
        if job.input_staged:  # a large payload: one GET here, it never went through a script (inputs.py)
            redis, keys = self.scripts.redis, self.scripts.keys
            try:
                payload = await until_redis_answers(lambda: read_input(redis, keys, job.session_id, job.job_id),
                                                    f"input of {job.session_id}/{job.step_id}")
            except InputGone as exc:
                raise StepFailed(ErrorCode.INFERENCE_ERROR, f"{exc}; send the step again", fallback=True) from exc
        try:
            return parse_step_input(job.mode, decode(payload, self.settings.limits), self.settings.limits)
        except FleetError as exc:
            raise StepFailed.of(exc) from exc

    async def _is_next(self, job: InboxEntry, state: SessionState) -> bool:
        """Answer a duplicate at once (False); raise for a job out of order; True when it is next."""
        if job.step_id <= state.committed:
            await self._answer_duplicate(job, state)
            return False
        state.checked_version = await self.staleness.before_run(job, state.max_staleness)
        if job.step_id != state.committed + 1:
            raise StepFailed(ErrorCode.STEP_OUT_OF_ORDER,
                             f"Expected step_id {state.committed + 1}, got {job.step_id} "
                             "(an earlier step of this session failed; resubmit from there).", fallback=False)
        return True

    async def _run_gated(self, job: InboxEntry, request: EngineRequest, state: SessionState | None) -> EngineRun:
        """The gate keeps weight updates out while this step (and its rebuild) uses the engine. An
        update that aborts in-flight steps sends this one back to the gate: it runs again on the new
        weights (the engine left the session's context as it was), whole, or under ``continue``
        from the tokens it had generated (``Continuation``)."""
        runs = Continuation(request)
        while True:
            self._raise_if_cancelled(job)  # also after an aborting update: a cancelled step never runs again
            async with self._gate(job) as version:
                if state is not None:  # an update it waited for at the gate may have made it stale
                    await self.staleness.in_gate(job, state.max_staleness, state.checked_version, version)
                try:
                    if state is not None and state.committed >= 0 and not state.engine_ready:
                        await self._rebuild(job, state)
                    out, attempt, engine_ms = await self._run_engine(job, runs.request, state)
                    return runs.output(out, version), attempt, engine_ms, version
                except StepAborted as exc:
                    if not self.gate.aborting:  # the engine stopped it on its own (only rebuilds get here)
                        raise StepFailed(ErrorCode.INFERENCE_ERROR, "the engine aborted the step without a "
                                         "weight update", fallback=True, dead_letter=True) from exc
                    self.aborted_steps += 1
                    kept = runs.aborted(exc, version, keep=self.gate.keeps_partial)
                    log.info("step %s/%d aborted for a weight update; it runs again after it (%d generated "
                             "tokens kept)", job.session_id, job.step_id, kept)

    def _gate(self, job: InboxEntry) -> contextlib.AbstractAsyncContextManager[int]:
        """Pass the weight gate; a step waiting there for its minimum policy version gives up after
        ``version_wait_s``, or at once when its session is closed or the worker drains."""
        version = self.gate.enter_now(job.min_version, model=job.model)
        if version is not None:  # the common case: nothing to wait for, nothing to stop
            return InGate(self.gate, version)
        return self._wait_at_gate(job)

    @contextlib.asynccontextmanager
    async def _wait_at_gate(self, job: InboxEntry) -> AsyncIterator[int]:
        stop = asyncio.Event()
        if self.draining:
            stop.set()
        waiting = self._gate_waits.setdefault(job.session_id, set())
        waiting.add(stop)
        try:
            async with self.gate.step(job.min_version, model=job.model, wait_s=self.settings.version_wait_s,
                                      stop=stop) as version:
                yield version
        except VersionWaitEnded as exc:
            self._raise_if_cancelled(job)
            raise self._version_failure(exc) from exc
        finally:
            waiting.discard(stop)
            if not waiting and self._gate_waits.get(job.session_id) is waiting:
                del self._gate_waits[job.session_id]

    def _raise_if_cancelled(self, job: InboxEntry) -> None:
        """A contextual step enqueued before a cancel of its session (workers/fork_cancel.py) never runs
        or commits: it answers ``cancelled`` and leaves next_step_id as the cancel set it."""
        if job.contextual and self.cancels.cancelled(job.session_id, job.cancels):
            raise StepFailed(ErrorCode.CANCELLED, f"step {job.step_id} was cancelled (Session.cancel); the "
                             "session goes on from its committed step", fallback=False)

    def stop_gate_waits(self, session_id: str | None = None) -> None:
        """A close of ``session_id`` (None: a drain of the worker) stops its steps waiting at the gate."""
        if session_id is None:
            self.draining = True
        for sid, events in self._gate_waits.items():
            if session_id in (None, sid):
                for event in events:
                    event.set()

    def _version_failure(self, exc: VersionWaitEnded) -> StepFailed:
        if not exc.stopped:
            return StepFailed(ErrorCode.TIMEOUT, f"waited {self.settings.version_wait_s:g}s at the weight gate: "
                              f"{exc}; send the step again later", fallback=True)
        if self.draining:
            return StepFailed(ErrorCode.TIMEOUT, f"the worker is draining: {exc}; send the step again",
                              fallback=True)
        return StepFailed(ErrorCode.SESSION_CLOSED, f"the session was closed while its step waited: {exc}",
                          fallback=False)

    async def _run_engine(self, job: InboxEntry, request: EngineRequest,
                          state: SessionState | None) -> tuple[EngineOutput, int, float]:
        batcher = self.batchers.get(job.model)
        if batcher is None:
            raise StepFailed(ErrorCode.INVALID_REQUEST, f"this worker does not serve model {job.model!r}",
                             fallback=True)
        attempt = 1
        while True:
            started = time.perf_counter()
            try:
                out = await batcher.run(request, job.priority)
                return out, attempt, (time.perf_counter() - started) * 1000.0
            except Exception as exc:
                await self._after_engine_failure(job, state, exc, attempt)
            attempt += 1

    async def _after_engine_failure(self, job: InboxEntry, state: SessionState | None, exc: Exception,
                                    attempt: int) -> None:
        """Raise what ends the step, or return (after a rebuild or a wait) to run it again."""
        last = attempt >= self.settings.max_attempts
        self._raise_if_cancelled(job)  # an aborted step of a cancelled session is not retried
        if isinstance(exc, InvalidRequestError):  # never retried
            raise StepFailed.of(exc, attempt=attempt) from exc
        if isinstance(exc, StepAborted) and self.gate.aborting:
            raise exc  # a weight update stopped it: _run_gated runs it again after the update
        if isinstance(exc, FleetError) and not isinstance(exc, TransientEngineError | StepAborted):
            if exc.code is not ErrorCode.CONTEXT_LOST or state is None or last:
                raise StepFailed.of(exc, attempt=attempt,
                                    dead_letter=exc.code is ErrorCode.INFERENCE_ERROR) from exc
            await self._recover_context(job, state, exc)
            return
        text = exc.message if isinstance(exc, FleetError) else str(exc)
        if last:
            raise StepFailed(ErrorCode.INFERENCE_ERROR, f"{type(exc).__name__}: {text}", fallback=True,
                             attempt=attempt, dead_letter=True) from exc
        delay = self.settings.retry_backoff_ms / 1000.0 * (2 ** (attempt - 1))
        log.warning("step %s/%d attempt %d failed (%s); retrying in %.3fs",
                    job.session_id, job.step_id, attempt, text, delay)
        await asyncio.sleep(delay * (0.5 + random.random()))

    async def _recover_context(self, job: InboxEntry, state: SessionState, exc: FleetError) -> None:
        """The engine lost the session's context (e.g. a remote server restarted): rebuild it from the
        committed step records so the step can run again, instead of failing the session."""
        log.warning("engine lost the context of %s (%s); rebuilding", job.session_id, exc.message)
        self.engine.drop_session(job.session_id)
        state.engine_ready = False
        if state.committed >= 0:
            await self._rebuild(job, state)

    async def _rebuild(self, job: InboxEntry, state: SessionState) -> None:
        """Rebuild the engine context of a session this worker took over."""
        batcher = self.batchers.get(job.model)
        try:
            if batcher is None:
                raise ContextLost(f"this worker does not serve model {job.model!r}")
            rebuilt = await rebuild_context(
                self.scripts.redis, self.scripts.keys, batcher, self.engine, session_id=job.session_id,
                model=job.model, mode=job.mode, committed=state.committed,
                version=self.engine.policy_version_of(job.model), gen=job.gen)
            self.metrics.rebuilt(rebuilt.ms / 1000.0)  # a histogram: bounded, however many rebuilds
            self.rebuilt_steps += state.committed + 1
            self.rebuild_engine_calls += rebuilt.engine_calls
            self.replayed_steps += rebuilt.replayed_steps
        except ContextLost as exc:
            self.engine.drop_session(job.session_id)
            raise StepFailed.of(exc) from exc
        state.engine_ready = True

    # ------------------------------------------------------------------ commits

    async def _commit(self, job: InboxEntry, result: StepResult, state: SessionState) -> bool:
        """Commit the step; False when it was committed before (the stored result went out again)."""
        assert result.output is not None
        payload = encode(result.to_wire())
        record = step_record(job.payload, result.output, version=result.policy_version,
                             context_length=result.context_length, mode=job.mode)

        def commit_call() -> Coroutine[Any, Any, tuple[CommitAnswer, int]]:
            return self.jobs.commit(job, payload, context_length=result.context_length, record=record,
                                    keep_records=records_kept(job.mode, job.retention),
                                    version=result.policy_version)

        async def commit_once() -> tuple[bool, int]:
            answer, acked = await commit_call()
            return self._apply_commit(job, state, answer), acked

        what = f"commit {job.session_id}/{job.step_id}"
        in_place = self.jobs.commits_in_place
        fresh, acked = await (settled_in_place(commit_once, what) if in_place else settled(commit_once, what))
        await self.replicas.confirm(job, acked, commit_call)  # replicated durability: then it is published
        return fresh

    def _apply_commit(self, job: InboxEntry, state: SessionState, answer: CommitAnswer) -> bool:
        if isinstance(answer, Committed):
            state.committed = job.step_id
            state.engine_ready = True
            self.committed_steps += 1
            self.stats.committed(time.time() * 1000.0 - job.enqueued_ms)
            return True
        # The engine ran a step that did not commit: its context is no longer the committed one.
        state.engine_ready = False
        self.engine.drop_session(job.session_id)
        if isinstance(answer, CancelledCommit):  # the session was cancelled while this step ran
            self.cancels.record(job.session_id, job.cancels + 1)
            self._raise_if_cancelled(job)
        if isinstance(answer, Duplicate):  # committed earlier; the stored result went out again
            state.committed = max(state.committed, job.step_id)
            self.metrics.duplicate(job.model)
            return False
        # Redis is behind this worker (only a lost commit gets here: the lane ran the step after the
        # one it committed), so the trainer re-sends from Redis's committed step + 1 (the fallback).
        state.committed = answer.committed_step_id
        raise StepFailed(ErrorCode.STEP_OUT_OF_ORDER, f"step {job.step_id} could not commit (committed step is "
                         f"{state.committed}: Redis lost later commits); send the steps again from "
                         f"{state.committed + 1}", fallback=True)

    async def _answer_duplicate(self, job: InboxEntry, state: SessionState) -> None:
        """A job for a step that is already committed: re-publish the stored result, never re-run."""
        def republish() -> Coroutine[Any, Any, tuple[CommitAnswer, int]]:
            return self.jobs.commit(job, b"", context_length=0)

        answer, acked = await settled(republish, f"duplicate {job.session_id}/{job.step_id}")
        if isinstance(answer, OutOfOrder):  # Redis is behind this worker: it lost the commit
            state.committed, state.engine_ready = answer.committed_step_id, False
            self.engine.drop_session(job.session_id)
            raise StepFailed(ErrorCode.STEP_OUT_OF_ORDER, f"step {job.step_id} is not committed in Redis (committed "
                             f"step is {answer.committed_step_id}): its commit was lost (a Redis failover before "
                             "a replica had it, or a restart without persistence); send it again", fallback=True)
        if not isinstance(answer, Duplicate):
            raise StepFailed(ErrorCode.STEP_ALREADY_COMMITTED,
                             f"step {job.step_id} is already committed and its result is no longer stored",
                             fallback=False)
        await self.replicas.confirm(job, acked, republish)  # a stored result a replica may not have yet
        self.metrics.duplicate(job.model)
