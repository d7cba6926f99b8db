"""Runs one job end to end: decode, engine (with retries), then commit or report through Lua.

Kept apart from the worker loop so the exactly-once rules live in one small place.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import TypeVar

from broker.redis.backoff import until_redis_answers
from broker.redis.scripts import ScriptReply, Scripts
from schemas.codec import decode, encode
from schemas.errors import (
    ContextLost,
    ErrorCode,
    Fenced,
    FleetError,
    InvalidRequestError,
    StepAborted,
    TransientEngineError,
)
from schemas.messages import Latency, StepResult, parse_step_input
from workers.batcher import Batcher
from workers.engines.base import Engine, EngineOutput, EngineRequest
from workers.jobs import Job
from workers.rebuild import rebuild_context, records_kept, step_record
from workers.settings import WorkerSettings
from workers.weights_gate import WeightGate

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class SessionState:
    """What this worker knows of a session it owns, at one lease epoch."""

    committed: int
    epoch: int
    engine_ready: bool = False  # the engine holds the context of every committed step


class StepExecutor:
    def __init__(self, settings: WorkerSettings, scripts: Scripts, engine: Engine,
                 batchers: dict[str, Batcher], gate: WeightGate) -> None:
        self.settings = settings
        self.gate = gate
        self.scripts = scripts
        self.engine = engine
        self.batchers = batchers
        self.worker_id = settings.worker_id
        self.committed_steps = 0
        self.failed_steps = 0
        self.rebuilt_steps = 0
        self.aborted_steps = 0  # runs stopped by an aborting weight update (each ran again)
        self.rebuild_ms: list[float] = []

    # ------------------------------------------------------------------ publishing

    async def report(self, job: Job, result: StepResult, *, fallback: bool,
                     dead_letter: dict[str, object] | None = None) -> None:
        """Publish a result that commits nothing; ``fallback`` lets the trainer retry the step."""
        payload = encode(result.to_wire())
        reply = await until_redis_answers(lambda: self.scripts.report(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, entry_id=job.entry_id,
            job_id=job.job_id, result=payload, fallback_gen=job.gen if fallback else None,
            reply_to=job.reply_to, reply_ttl_ms=self.settings.reply_ttl_ms, dead_letter=dead_letter,
        ), f"report {job.session_id}/{job.step_id}")
        if reply.status == "fenced":
            raise Fenced(job.session_id)

    async def fail(self, job: Job, code: ErrorCode, message: str, state: SessionState | None, *,
                   fallback: bool, attempt: int = 0, dead_letter: bool = False) -> None:
        self.failed_steps += 1
        result = StepResult.failure(
            job.session_id, job.step_id, code, message,
            committed_step_id=state.committed if state else -1, worker_id=self.worker_id, attempt=attempt,
            policy_version=self.engine.policy_version,
        )
        fields = (job.dead_letter_fields(f"{code.value}: {message}", attempt, self.worker_id,
                                         int(time.time() * 1000)) if dead_letter else None)
        await self.report(job, result, fallback=fallback, dead_letter=fields)

    # ------------------------------------------------------------------ steps

    async def run_step(self, job: Job, state: SessionState | None) -> None:
        """A contextual step (``state`` given) or a stateless one (``state`` None)."""
        picked_ms = time.time() * 1000.0
        if state is not None and not await self._in_order(job, state):
            return
        try:
            step = parse_step_input(job.mode, decode(job.payload, self.settings.limits), self.settings.limits)
        except FleetError as exc:
            await self.fail(job, exc.code, exc.message, state, fallback=True)
            return
        request = EngineRequest(
            session_key=job.session_id if state is not None else f"{job.session_id}:stateless",
            model=job.model, step=step, reset=state is not None and state.committed == -1,
            stateless=state is None,
        )
        # The gate keeps weight updates out while this step (and its rebuild) uses the engine. An
        # update that aborts in-flight steps sends this one back to the gate: it runs again, whole,
        # on the new weights (the engine left the session's context as it was).
        while True:
            async with self.gate.step(job.min_version) as version:
                try:
                    if state is not None and state.committed >= 0 and not state.engine_ready \
                            and not await self._rebuild(job, state):
                        return
                    outcome = await self._run_engine(job, request, state)
                except StepAborted:
                    if not self.gate.aborting:  # the engine stopped it on its own (only rebuilds get here)
                        await self.fail(job, ErrorCode.INFERENCE_ERROR, "the engine aborted the step "
                                        "without a weight update", state, fallback=True, dead_letter=True)
                        return
                    self.aborted_steps += 1
                    log.info("step %s/%d aborted for a weight update; it runs again after it",
                             job.session_id, job.step_id)
                    continue
            break
        if outcome is None:
            return
        out, attempt, engine_ms = outcome
        result = StepResult(
            session_id=job.session_id, step_id=job.step_id, ok=True,
            committed_step_id=job.step_id if state is not None else (-1),
            output=out.output, context_length=out.context_length,
            latency=Latency(queue_ms=max(0.0, picked_ms - job.enqueued_ms), engine_ms=engine_ms),
            worker_id=self.worker_id, attempt=attempt, policy_version=version,
        )
        if state is None:
            await self.report(job, result, fallback=False)
            return
        await self._commit(job, result, state)

    async def _in_order(self, job: Job, state: SessionState) -> bool:
        """Answer a duplicate or an out-of-order job at once; True when the job is next."""
        if job.step_id <= state.committed:
            await self._answer_duplicate(job, state)
            return False
        if job.step_id != state.committed + 1:
            await self.fail(job, ErrorCode.STEP_OUT_OF_ORDER,
                            f"expected step_id {state.committed + 1}, got {job.step_id} "
                            "(an earlier step of this session failed; resubmit from there)",
                            state, fallback=False)
            return False
        return True

    async def _run_engine(self, job: Job, request: EngineRequest,
                          state: SessionState | None) -> tuple[EngineOutput, int, float] | None:
        batcher = self.batchers.get(job.model)
        if batcher is None:
            await self.fail(job, ErrorCode.INVALID_REQUEST, f"this worker does not serve model {job.model!r}",
                            state, fallback=True)
            return None
        attempts = self.settings.max_attempts
        for attempt in range(1, attempts + 1):
            started = time.perf_counter()
            try:
                out = await batcher.run(request)
                return out, attempt, (time.perf_counter() - started) * 1000.0
            except InvalidRequestError as exc:  # never retried
                await self.fail(job, exc.code, exc.message, state, fallback=True, attempt=attempt)
                return None
            except FleetError as exc:
                if isinstance(exc, TransientEngineError | StepAborted):
                    if not await self._retry_or_fail(job, state, exc, attempt):
                        return None
                    continue
                # The engine lost the session's context (e.g. a remote server restarted): rebuild it
                # from the committed step records and try again, instead of failing the session.
                if exc.code is not ErrorCode.CONTEXT_LOST or state is None or attempt == attempts:
                    await self.fail(job, exc.code, exc.message, state, fallback=True, attempt=attempt,
                                    dead_letter=exc.code is ErrorCode.INFERENCE_ERROR)
                    return None
                log.warning("engine lost the context of %s (%s); rebuilding", job.session_id, exc.message)
                self.engine.drop_session(job.session_id)
                state.engine_ready = False
                if state.committed >= 0 and not await self._rebuild(job, state):
                    return None
            except Exception as exc:
                if not await self._retry_or_fail(job, state, exc, attempt):
                    return None
        return None  # pragma: no cover - the loop always returns

    async def _retry_or_fail(self, job: Job, state: SessionState | None, exc: Exception, attempt: int) -> bool:
        if isinstance(exc, StepAborted) and self.gate.aborting:
            raise exc  # a weight update stopped it: run_step runs it again after the update
        text = exc.message if isinstance(exc, FleetError) else str(exc)
        if attempt == self.settings.max_attempts:
            await self.fail(job, ErrorCode.INFERENCE_ERROR, f"{type(exc).__name__}: {text}", state,
                            fallback=True, attempt=attempt, dead_letter=True)
            return False
        delay = self.settings.retry_backoff_ms / 1000.0 * (2 ** (attempt - 1))
        log.warning("step %s/%d attempt %d failed (%s); retrying in %.3fs",
                    job.session_id, job.step_id, attempt, text, delay)
        await asyncio.sleep(delay * (0.5 + random.random()))
        return True

    async def _rebuild(self, job: Job, state: SessionState) -> bool:
        """Rebuild the engine context of a session this worker took over; False if it failed."""
        batcher = self.batchers.get(job.model)
        try:
            if batcher is None:
                raise ContextLost(f"this worker does not serve model {job.model!r}")
            self.rebuild_ms.append(await rebuild_context(
                self.scripts.redis, self.scripts.keys, batcher, session_id=job.session_id, model=job.model,
                mode=job.mode, committed=state.committed, version=self.engine.policy_version))
            self.rebuilt_steps += state.committed + 1
        except ContextLost as exc:
            self.engine.drop_session(job.session_id)
            await self.fail(job, ErrorCode.CONTEXT_LOST, exc.message, state, fallback=True)
            return False
        state.engine_ready = True
        return True

    async def _commit(self, job: Job, result: StepResult, state: SessionState) -> None:
        assert result.output is not None
        payload = encode(result.to_wire())
        record = step_record(job.payload, result.output, version=result.policy_version,
                             context_length=result.context_length, mode=job.mode)
        reply: ScriptReply = await until_redis_answers(lambda: self.scripts.commit(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=payload, context_length=result.context_length,
            job_id=job.job_id, reply_to=job.reply_to, reply_ttl_ms=self.settings.reply_ttl_ms,
            record=record, keep_records=records_kept(job.mode, job.retention),
        ), f"commit {job.session_id}/{job.step_id}")
        if reply.status == "committed":
            state.committed = job.step_id
            state.engine_ready = True
            self.committed_steps += 1
            return
        if reply.status == "fenced":
            raise Fenced(job.session_id)
        # The engine ran a step that did not commit: its context is no longer the committed one.
        state.engine_ready = False
        self.engine.drop_session(job.session_id)
        if reply.status == "duplicate":  # committed earlier; the stored result went out again
            state.committed = max(state.committed, job.step_id)
            return
        state.committed = reply.integer(0)
        await self.fail(job, ErrorCode.STEP_OUT_OF_ORDER, f"step {job.step_id} could not commit "
                        f"(committed step is {state.committed})", state, fallback=False)

    async def _answer_duplicate(self, job: Job, state: SessionState) -> None:
        """A job for a step that is already committed: re-publish the stored result, never re-run."""
        reply = await until_redis_answers(lambda: self.scripts.commit(
            session_id=job.session_id, worker_id=self.worker_id, epoch=job.epoch, step_id=job.step_id,
            entry_id=job.entry_id, result=b"", context_length=0, job_id=job.job_id, reply_to=job.reply_to,
            reply_ttl_ms=self.settings.reply_ttl_ms,
        ), f"duplicate {job.session_id}/{job.step_id}")
        if reply.status == "fenced":
            raise Fenced(job.session_id)
        if reply.status != "duplicate":
            await self.fail(job, ErrorCode.STEP_ALREADY_COMMITTED,
                            f"step {job.step_id} is already committed and its result is no longer stored",
                            state, fallback=False)
