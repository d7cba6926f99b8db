"""A session seen from the trainer: submit steps in order (pipelined), follow ownership moves,
ride out a Redis outage, reset, close, fork into branches and cancel (what fork and cancel
guarantee: docs/async_rl.md).

A Session holds its cell's link (:class:`broker.client.link.CellLink`): the keys, scripts, reply
reader, limits and bounds of that cell, never the client that made it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from broker.client.link import LinkSource
from broker.redis.backoff import REDIS_ERRORS, Backoff
from broker.redis.keys import CELL_MARK, cell_named_by, check_stream_name
from broker.redis.layouts import ReplyEntry
from broker.redis.refusals import refusal_of
from broker.redis.script_replies import (
    AlreadyClosed,
    Cancelled,
    ControlReply,
    EnqueueReply,
    Forked,
    Moved,
    Queued,
    Refused,
    Stored,
)
from schemas.codec import encode
from schemas.errors import (
    ErrorCode,
    FleetError,
    FleetTimeoutError,
    InvalidRequestError,
    PayloadTooLargeError,
    RedisUnavailableError,
    error_for,
)
from schemas.messages import ErrorInfo, Mode, SessionStatus, StepResult, parse_step_input
from schemas.wire_fields import as_step_id, or_default

_MAX_MOVES = 8  # owner changes followed in one call before giving up
_MAX_UNANSWERED = 64  # steps per session whose timed-out send a re-send may wait for
MAX_BRANCHES = 256  # one fork's branches: every branch is a key pair in one atomic script call
_Reply = TypeVar("_Reply")


_ID_BYTES = 16
_ID_BATCH = 256  # ids drawn per getrandom: one system call per 256 steps, not one per step
_id_pool: list[bytes] = []


def new_id() -> str:
    """A fresh job, session or client id: 128 random bits as 32 hex digits (uuid4's ``.hex`` shape,
    without building a UUID object on every step). The bits come from ``os.urandom``, drawn for
    ``_ID_BATCH`` ids at a time; a forked child drops the parent's unused ones (never shared)."""
    if not _id_pool:
        block = os.urandom(_ID_BYTES * _ID_BATCH)
        _id_pool.extend(block[i:i + _ID_BYTES] for i in range(0, len(block), _ID_BYTES))
    return _id_pool.pop().hex()


os.register_at_fork(after_in_child=_id_pool.clear)


class Session:
    """One session: steps are numbered by the trainer from 0; ``submit`` pipelines them."""

    def __init__(self, source: LinkSource, session_id: str, *, model: str, mode: Mode, owner: str) -> None:
        self.link = source.link_for(session_id)  # every call of this session goes to this cell
        self.session_id = session_id
        self.cell = self.link.keys.cell
        self.model = model
        self.mode = mode
        self.owner = owner
        # Enqueues of one session leave in submit order (asyncio.Lock wakes waiters FIFO).
        self._order = asyncio.Lock()
        self._unanswered: dict[int, str] = {}  # step id -> job id of a send that answered timeout

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, model={self.model!r}, mode={self.mode.value!r})"

    # ------------------------------------------------------------------ steps

    def submit(
        self,
        step_id: int,
        *,
        observation: Mapping[str, Any] | None = None,
        action: Mapping[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Mapping[str, Any] | None = None,
        return_routed_experts: bool = False,
        multimodal: Mapping[str, Any] | None = None,
        use_session_context: bool = True,
        timeout: float | None = None,
        min_policy_version: int = 0,
    ) -> asyncio.Task[StepResult]:
        """Enqueue a step and return at once; the task resolves to its StepResult.

        Steps submitted one after another keep their order. Bad input resolves to an
        ``invalid_request`` (or ``payload_too_large``) result and sends nothing.
        """
        payload = self._payload_or_failure(step_id, observation, action, token_ids, sampling,
                                           return_routed_experts, multimodal)
        if isinstance(payload, StepResult):
            return asyncio.ensure_future(_resolved(payload))
        return asyncio.create_task(self._run_step(step_id, payload, use_session_context, timeout,
                                                  min_policy_version))

    async def _step(self, step_id: int, *, observation: Mapping[str, Any] | None = None,
                    action: Mapping[str, Any] | None = None, token_ids: Sequence[int] | None = None,
                    sampling: Mapping[str, Any] | None = None, return_routed_experts: bool = False,
                    multimodal: Mapping[str, Any] | None = None, use_session_context: bool = True,
                    timeout: float | None = None, min_policy_version: int = 0) -> StepResult:
        """:meth:`submit`'s work in the caller's task (no task of its own to create and wake)."""
        payload = self._payload_or_failure(step_id, observation, action, token_ids, sampling,
                                           return_routed_experts, multimodal)
        if isinstance(payload, StepResult):
            return payload
        return await self._run_step(step_id, payload, use_session_context, timeout, min_policy_version)

    async def enqueue(
        self,
        step_id: int,
        *,
        results_stream: str,
        observation: Mapping[str, Any] | None = None,
        action: Mapping[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: Mapping[str, Any] | None = None,
        return_routed_experts: bool = False,
        multimodal: Mapping[str, Any] | None = None,
        use_session_context: bool = True,
        min_policy_version: int = 0,
    ) -> Enqueued:
        """Enqueue a step whose result goes to a shared results stream (read by a consumer group,
        see :class:`broker.client.consumer.ResultConsumer`) instead of back to this client. Returns once the
        step is queued, so a producer process can feed sessions while trainer processes consume.
        Steps enqueued one after another keep their order. The step's inputs are :meth:`submit`'s."""
        try:
            as_step_id(step_id)
            check_stream_name(results_stream)
            payload = self._payload(observation, action, token_ids, sampling, return_routed_experts, multimodal)
            async with self._order:
                reply = await self._send_step(
                    lambda owner: self.link.scripts.enqueue(
                        self.session_id, owner, step_id=step_id, contextual=use_session_context,
                        job_id=new_id(), reply_to=results_stream, payload=payload, min_version=min_policy_version,
                    )
                )
        except FleetError as exc:
            return Enqueued(step_id, EnqueueStatus.ERROR, -1, ErrorInfo(exc.code, exc.message))
        if isinstance(reply, Queued):
            return Enqueued(step_id, EnqueueStatus.QUEUED, reply.committed_step_id)
        if isinstance(reply, Stored):
            return Enqueued(step_id, EnqueueStatus.COMMITTED, reply.committed_step_id)
        return Enqueued(step_id, EnqueueStatus.ERROR, reply.committed_step_id, ErrorInfo(reply.code, reply.message))

    async def step(self, step_id: int, **kwargs: Any) -> StepResult:
        """Submit a step and wait for its result (see :meth:`submit` for the arguments)."""
        return await self._step(step_id, **kwargs)

    def _payload_or_failure(self, step_id: int, observation: Mapping[str, Any] | None,
                            action: Mapping[str, Any] | None, token_ids: Sequence[int] | None,
                            sampling: Mapping[str, Any] | None, return_routed_experts: bool,
                            multimodal: Mapping[str, Any] | None) -> bytes | StepResult:
        """The step's payload, or the failed result bad input answers (nothing is sent)."""
        try:
            return self._payload(observation, action, token_ids, sampling, return_routed_experts, multimodal)
        except FleetError as exc:
            return StepResult.failure(self.session_id, step_id, exc.code, exc.message)

    def _payload(self, observation: Mapping[str, Any] | None, action: Mapping[str, Any] | None,
                 token_ids: Sequence[int] | None, sampling: Mapping[str, Any] | None,
                 routed: bool, multimodal: Mapping[str, Any] | None) -> bytes:
        if self.mode is Mode.WORLD_MODEL_ENV:
            if token_ids is not None or sampling is not None:
                raise InvalidRequestError("a world_model_env step takes observation and action, not tokens")
            data: dict[str, Any] = {"observation": observation, "action": action}
        else:
            if observation is not None or action is not None:
                raise InvalidRequestError("a tokens step takes token_ids and sampling, not observations")
            data = {"token_ids": token_ids, "sampling": or_default(sampling, {}), "return_routed_experts": routed,
                    "multimodal": or_default(multimodal, {})}
        limits = self.link.limits
        step = parse_step_input(self.mode, data, limits)
        payload = encode(step.to_wire(), limits)  # an array over the limits is refused before it is sent
        if len(payload) > limits.max_payload_bytes:
            raise PayloadTooLargeError(f"payload is {len(payload)} bytes; limit is {limits.max_payload_bytes}")
        return payload

    async def _run_step(self, step_id: int, payload: bytes, contextual: bool,
                        timeout: float | None, min_version: int = 0) -> StepResult:
        try:
            as_step_id(step_id)
        except InvalidRequestError as exc:
            return StepResult.failure(self.session_id, -1, exc.code, exc.message)
        started = time.perf_counter()
        job_id = new_id()
        replies = self.link.replies
        waiter = replies.expect(job_id, worker_id=self.owner)
        earlier = self._unanswered.pop(step_id, None) if contextual else None
        # Expected before the enqueue is sent: a reply published meanwhile cannot slip by.
        earlier_waiter = replies.expect(earlier, worker_id=self.owner) if earlier is not None else None
        try:
            async with self._order:
                reply = await self._send_step(
                    lambda owner: self.link.scripts.enqueue(
                        self.session_id, owner, step_id=step_id, contextual=contextual, job_id=job_id,
                        reply_to=self.link.client_id, payload=payload, min_version=min_version,
                    )
                )
        except FleetError as exc:
            replies.forget(job_id)
            self._forget_earlier(earlier)
            return StepResult.failure(self.session_id, step_id, exc.code, exc.message)
        if earlier is not None and earlier_waiter is not None and isinstance(reply, Refused) and reply.in_flight:
            # Our own earlier send of this step (it answered timeout) is still queued or running:
            # its result is this step's result, so wait for it rather than answer step_out_of_order.
            replies.forget(job_id)
            job_id, waiter, reply = earlier, earlier_waiter, Queued("", reply.committed_step_id)
        else:
            self._forget_earlier(earlier)
            replies.sent_to(job_id, self.owner)  # the owner that queued it, after any move
        if isinstance(reply, Stored):
            replies.forget(job_id)
            result = self.link.decode_result(ReplyEntry("step", job_id, reply.committed_step_id, reply.result),
                                             started)
            return dataclasses.replace(result, duplicate=True)
        if isinstance(reply, Refused):
            replies.forget(job_id)
            return StepResult.failure(self.session_id, step_id, reply.code, reply.message,
                                      committed_step_id=reply.committed_step_id,
                                      context_length=reply.context_length)
        try:
            answer = await self.link.wait_for_reply(self.session_id, waiter, timeout)
        except FleetTimeoutError:
            replies.forget(job_id)
            if contextual:
                self._remember_unanswered(step_id, job_id)
            return StepResult.failure(
                self.session_id, step_id, ErrorCode.TIMEOUT,
                f"no result within {self.link.bounds.wait_s(timeout)}s; the step is still queued and may "
                "commit later (re-send the same step_id to get its stored result)",
                committed_step_id=reply.committed_step_id)
        except FleetError as exc:
            replies.forget(job_id)
            return StepResult.failure(self.session_id, step_id, exc.code, exc.message,
                                      committed_step_id=reply.committed_step_id)
        return self.link.decode_result(answer, started)

    def _remember_unanswered(self, step_id: int, job_id: str) -> None:
        """A step that answered timeout: still queued, it may commit later. A re-send finding it in
        flight waits for its result (bounded: the oldest are forgotten first)."""
        self._unanswered[step_id] = job_id
        while len(self._unanswered) > _MAX_UNANSWERED:
            del self._unanswered[next(iter(self._unanswered))]

    def _forget_earlier(self, earlier: str | None) -> None:
        if earlier is not None:
            self.link.replies.forget(earlier)

    async def _send_step(self, call: Callable[[str], Awaitable[EnqueueReply]]) -> Queued | Stored | Refused:
        """:meth:`_send` for an enqueue. If a reply was lost in an outage and the retry finds our step
        in flight, the first attempt landed (its result is on its way to us): report it as queued."""
        reply, lost = await self._send(call)
        if isinstance(reply, Moved):
            raise self._kept_moving()
        if lost and isinstance(reply, Refused) and reply.in_flight:
            return Queued("", reply.committed_step_id)
        return reply

    async def _send_control(self, call: Callable[[str], Awaitable[ControlReply]]) -> Queued | AlreadyClosed | Refused:
        reply, _ = await self._send(call)
        if isinstance(reply, Moved):
            raise self._kept_moving()
        return reply

    def _kept_moving(self) -> FleetError:
        return FleetTimeoutError(f"session {self.session_id} kept moving between workers")

    async def _send(self, call: Callable[[str], Awaitable[_Reply]]) -> tuple[_Reply, bool]:
        """Run a script against the believed owner's inbox, following up to ``_MAX_MOVES``
        ownership moves and riding out a Redis outage (reconnect with backoff, up to
        ``FleetClient.reconnect_s``). Returns the reply (Moved once the session kept moving) and
        whether an earlier attempt's reply was lost in the outage."""
        moves, lost, backoff = 0, False, Backoff()
        deadline = time.monotonic() + self.link.bounds.reconnect_s
        while True:
            try:
                reply = await call(self.owner)
            except REDIS_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise unavailable(exc, self.link.bounds.reconnect_s) from exc
                lost = lost or refusal_of(exc) is None  # a refused call wrote nothing
                await backoff.wait()
                continue
            if isinstance(reply, Moved) and moves < _MAX_MOVES:
                moves += 1
                self.owner = reply.owner
                continue
            return reply, lost

    # ------------------------------------------------------------------ control

    async def reset(self, *, timeout: float | None = None) -> int:
        """Reset the session: queued steps run first, then committed goes back to -1 and the
        engine drops the context. Returns the committed step id (-1) once the owner applied it."""
        return await self._control("reset", wait=True, timeout=timeout)

    async def close(self) -> None:
        """Close the session. Later steps get ``session_closed``; closing twice is fine."""
        await self._control("close", wait=False, timeout=None)

    async def status(self) -> SessionStatus:
        return await self.link.status(self.session_id)

    async def fork(self, n: int) -> list[Session]:
        """``n`` new sessions (branches) that start from this session's committed step, on its worker:
        each steps on from committed + 1 on its own. Raises step_out_of_order while steps of this
        session are queued, capacity_exhausted when its worker has no room for all ``n``."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BRANCHES:
            raise InvalidRequestError(f"fork takes a number of branches in [1, {MAX_BRANCHES}], got {n!r}")
        branches = [branch_id(self.session_id) for _ in range(n)]
        async with self._order:
            reply = await self._send_moving(lambda owner: self.link.scripts.fork(
                self.session_id, owner, mode=self.mode.value, model=self.model, branches=branches))
        if isinstance(reply, Refused):
            raise error_for(reply.code, reply.message)
        assert isinstance(reply, Forked)
        return [Session(self.link, sid, model=self.model, mode=self.mode, owner=self.owner) for sid in branches]

    async def cancel(self) -> CancelOutcome:
        """Cancel the steps that have not committed (queued or running): each answers ``cancelled``;
        the session goes on from its committed step + 1. The refusal (session_not_found,
        session_closed) is raised as its error."""
        async with self._order:
            reply = await self._send_moving(lambda owner: self.link.scripts.cancel(self.session_id, owner))
        if isinstance(reply, Refused):
            raise error_for(reply.code, reply.message)
        assert isinstance(reply, Cancelled)
        first = reply.committed_step_id + 1
        return CancelOutcome(reply.committed_step_id, reply.next_step_id,
                             range(first, max(first, reply.next_before)))

    async def _send_moving(self, call: Callable[[str], Awaitable[_Reply | Moved]]) -> _Reply:
        """:meth:`_send`, with a session that kept moving raised as a timeout."""
        reply, _ = await self._send(call)
        if isinstance(reply, Moved):
            raise self._kept_moving()
        return reply

    async def _control(self, kind: str, *, wait: bool, timeout: float | None) -> int:
        job_id = new_id()
        replies = self.link.replies
        waiter = replies.expect(job_id)
        async with self._order:
            reply = await self._send_control(
                lambda owner: self.link.scripts.control(
                    self.session_id, owner, kind=kind, job_id=job_id, reply_to=self.link.client_id
                )
            )
        if isinstance(reply, Refused):
            replies.forget(job_id)
            raise error_for(reply.code, reply.message)
        if isinstance(reply, AlreadyClosed) or not wait:
            replies.forget(job_id)
            return reply.committed_step_id
        try:
            answer = await self.link.wait_for_reply(self.session_id, waiter, timeout)
        finally:
            replies.forget(job_id)
        return answer.committed


def unavailable(exc: Exception, waited_s: float) -> FleetError:
    """The answer to a Redis that did not take a call within the reconnect window: ``redis_unavailable``
    with the reason when it refused writes (broker/redis/refusals.py), else ``timeout``."""
    reason = refusal_of(exc)
    if reason is not None:
        return RedisUnavailableError(f"redis refused writes ({reason.value}) for {waited_s:g}s; nothing was "
                                     f"written, send it again once Redis writes again: {exc}")
    return FleetTimeoutError(f"redis unreachable for {waited_s:g}s: {exc}")


async def _resolved(result: StepResult) -> StepResult:
    return result


class EnqueueStatus(StrEnum):
    """What :meth:`Session.enqueue` did with a step."""

    QUEUED = "queued"
    COMMITTED = "committed"  # already committed: its result went to the results stream then
    ERROR = "error"


@dataclass(frozen=True)
class Enqueued:
    """Answer to :meth:`Session.enqueue`: ``queued``, ``committed`` (the step was already committed;
    its result went to the results stream then) or ``error``."""

    step_id: int
    status: EnqueueStatus
    committed_step_id: int
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel did: ``cancelled_steps`` (those queued or running; each answers ``cancelled``)
    and the session's committed step and next step id after it (committed + 1; 0 behind a reset)."""

    committed_step_id: int
    next_step_id: int
    cancelled_steps: range


def branch_id(parent_id: str) -> str:
    """A fresh session id in the parent's cell."""
    cell = cell_named_by(parent_id)
    fresh = uuid.uuid4().hex
    return fresh if cell is None else f"{fresh}{CELL_MARK}{cell}"
