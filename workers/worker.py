"""The worker process: register, heartbeat, read the inbox, run each session's jobs in order.

One reader fills per-session lanes (bounded by ``max_inflight``); lanes of different sessions run
concurrently and meet in the per-model batchers; commits go through the fenced Lua script.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from broker.redis.aio import resolve
from broker.redis.backoff import (
    REDIS_ERRORS,
    Backoff,
    cancel_and_wait,
    raise_if_cancelling,
    until_redis_answers,
    wait_set,
)
from broker.redis.connect import open_redis
from broker.redis.inbox import BadEntry, InboxEntry, JobKind, parse_inbox_entry
from broker.redis.keys import INBOX_GROUP
from broker.redis.layouts import READS_FIELD, READS_PACKED, SessionHash
from broker.redis.memory_policy import warn_if_evicting
from broker.redis.refusals import refusal_of
from broker.redis.scripts import Scripts
from schemas.errors import ErrorCode, Fenced
from schemas.sharing import Priority
from workers.batcher import Batcher
from workers.drain import Drain
from workers.engines.base import Engine
from workers.executor import SessionState, StepExecutor
from workers.fork_cancel import ForkCancel
from workers.heartbeat import Heartbeats
from workers.idle import IdleSweeper
from workers.inbox_repair import recreate_inbox
from workers.job_scripts import FencedEntries, StepFailed, reject_malformed, settled
from workers.placement import pool_caps, pressure
from workers.rate_limit import WarningLimiter
from workers.readiness import Readiness
from workers.reaper import reap_loop
from workers.rebalance import Movable, Rebalancer
from workers.result_server import ResultServer
from workers.settings import WorkerSettings, new_worker_id
from workers.weight_control import WeightControl
from workers.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)
Entry = InboxEntry | BadEntry  # what the reader admits: a parsed job or a malformed entry


class WorkerState(StrEnum):
    """A worker's state, as its registry hash and the pools' leave call carry it."""

    STARTING = "starting"
    ACTIVE = "active"  # registered, reading its inbox
    DRAINING = "draining"  # stopped reading; finishing what it read, then handing over
    STOPPED = "stopped"


class Admission:
    """Admission of inbox entries into running jobs (``max_inflight``), interactive first.

    The reader admits entries in inbox order. With plain slots, a reader blocked on a bulk entry
    would leave an interactive entry behind it unread until that bulk entry got its slot. Here a bulk
    entry that finds no slot waits in a bounded backlog of its own (``backlog``: the reader reads on
    until that many wait), and a freed slot goes to an interactive entry first, then to the backlog
    in order. Order per session holds: once a session has an entry in the backlog, its later entries
    (whatever their class) queue behind it; a session's other jobs go to its lane, one at a time.
    ``acquire``/``release`` keep the semaphore's interface for code that needs one slot.
    """

    def __init__(self, limit: int, backlog: int) -> None:
        self._free = limit
        self._backlog_limit = max(1, backlog)
        self._backlog: collections.deque[tuple[Entry, Callable[[Entry], None]]] = collections.deque()
        self._held: collections.Counter[str] = collections.Counter()  # sessions in the backlog
        self._held_ids: set[str] = set()  # entry ids in the backlog (a history read skips them)
        self._interactive_waiting = 0
        self._changed = asyncio.Event()  # set on every release

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    @property
    def interactive_waiting(self) -> int:
        return self._interactive_waiting

    def holds(self, entry_id: str) -> bool:
        """Whether the entry waits in the backlog (read, not dispatched yet)."""
        return entry_id in self._held_ids

    async def acquire(self) -> None:
        """One slot, as a semaphore gives it."""
        while self._free <= 0:
            self._changed.clear()
            await self._changed.wait()
        self._free -= 1

    def release(self) -> None:
        self._free += 1
        if not self._interactive_waiting:  # a waiting interactive entry takes this slot first
            self._run_backlog()
        self._changed.set()

    async def admit(self, job: InboxEntry | BadEntry, dispatch: Callable[[InboxEntry | BadEntry], None]) -> None:
        """``dispatch(job)`` now or once a slot frees; returns when the reader may read on."""
        session = job.session_id or ""
        if isinstance(job, InboxEntry) and job.priority is Priority.INTERACTIVE and session not in self._held:
            self._interactive_waiting += 1
            try:
                await self.acquire()
            except BaseException:  # the reader stops: slots it left alone go to the backlog
                self._interactive_waiting -= 1
                self._run_backlog()
                raise
            self._interactive_waiting -= 1
            dispatch(job)
            self._run_backlog()  # slots freed while it waited and left for it
            return
        if self._free > 0 and not self._backlog:
            self._free -= 1
            dispatch(job)
            return
        self._backlog.append((job, dispatch))
        self._held[session] += 1
        self._held_ids.add(job.entry_id)
        while len(self._backlog) >= self._backlog_limit:
            self._changed.clear()
            await self._changed.wait()

    def _run_backlog(self) -> None:
        while self._free > 0 and self._backlog:
            job, dispatch = self._backlog.popleft()
            session = job.session_id or ""
            self._held[session] -= 1
            if not self._held[session]:
                del self._held[session]
            self._held_ids.discard(job.entry_id)
            self._free -= 1
            dispatch(job)


class Worker:
    """``async with Worker(engine, settings) as w: await w.serve()``; ``request_stop()`` drains."""

    def __init__(self, engine: Engine, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.id = settings.worker_id
        self.keys = settings.cell_config.keys
        self.state = WorkerState.STARTING
        self._redis: Redis | None = None
        self._scripts: Scripts | None = None
        self._executor: StepExecutor | None = None
        self._batchers: dict[str, Batcher] = {}
        self._sessions: dict[str, SessionState] = {}
        self._lanes: dict[str, collections.deque[InboxEntry]] = {}
        self._lane_done = asyncio.Event()  # set when a session's lane empties (it is between steps)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on
        self._inflight = Admission(settings.max_inflight, backlog=settings.read_count)  # interactive first
        self._running: set[str] = set()  # inbox entry ids read and not finished
        self._active = 0
        self._idle = asyncio.Event()
        self._stop = asyncio.Event()
        self.weights: WeightControl | None = None
        self._fenced: FencedEntries | None = None
        self._idle_sweeper: IdleSweeper | None = None
        self._beats: Heartbeats | None = None
        self._inbox_read: asyncio.Task[Any] | None = None  # the reader's blocked XREADGROUP, if any
        self._bad_entries = WarningLimiter(log)  # forged or broken entries can come by the thousand
        self.metrics = WorkerMetrics(settings.metrics_port, engine.models())
        self.readiness = Readiness(engine, capacity=settings.capacity, metrics=self.metrics.fleet,
                                   busy=lambda: self.weights is not None and self.weights.gate.updating)
        self.metrics.watch(engine, self._sessions, self._running)  # gauges read at each scrape
        self._pools = [self.keys.pool(mode.value, model) for model, mode in engine.models().items()]
        self._pool_caps = pool_caps(engine, self.keys, settings.capacity)  # the engine's per-model split
        self._drain: Drain | None = None
        self._beat_error = ""  # why the last heartbeat failed ("" once one succeeds)
        self._fork_cancel = ForkCancel(lambda: self.executor, self._sessions)  # cancel and fork entries
        self._results: ResultServer | None = None  # large results handed to trainers directly

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def executor(self) -> StepExecutor:
        assert self._executor is not None, "worker not started"
        return self._executor

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.start(self.ready_now)  # first: a taken port fails the start before anything else is open
        if self.settings.serve_results is not None:  # so does the result server's; registering says where
            self._results = ResultServer(self.metrics.held_results(self.settings), self.settings.serve_results,
                                         self.settings.results_advertise)
            try:
                await self._results.start()
            except OSError:
                self.metrics.close()
                raise
        self._redis = open_redis(self.settings.cell_config.redis_url, decode_responses=False)
        self._scripts = Scripts(self._redis, self.keys)
        self._scripts.on_refusal = self.metrics.refused  # counted and logged once (rate-limited)
        await warn_if_evicting(self._redis, f"worker {self.id}")  # broker/redis/memory_policy.py
        await self.engine.start()
        self._batchers = {
            model: Batcher(self.engine, model, max_batch=self.engine.max_batch_size(model), metrics=self.metrics,
                           wait_ms=self.settings.batch_wait_ms, in_flight=self.engine.batches_in_flight(model))
            for model in self.engine.models()
        }
        self.weights = WeightControl(self.engine, self._redis, self.keys, block_ms=self.settings.block_ms)
        self._executor = StepExecutor(self.settings, self._scripts, self.engine, self._batchers,
                                      self.weights.gate, self.metrics)
        self._fenced = FencedEntries(self._executor.jobs)
        if self._results is not None:
            self._executor.jobs.held = self._results.held
        lease_ms = self.settings.cell_config.lease_ms
        self._beats = Heartbeats(self._scripts, heartbeat_ms=self.settings.heartbeat_ms, lease_ms=lease_ms)
        beats = self._beats
        self._idle_sweeper = IdleSweeper(self._scripts, lambda: self.id, interval_s=self.settings.idle_sweep_s,
                                         served=lambda: list(self._sessions),
                                         owned=lambda: (beats.owned, beats.full_beats))
        await self.weights.apply_latest()
        await self.readiness.probe()  # a worker whose engine is not ready registers with no capacity
        await self._register(WorkerState.ACTIVE)
        self.state = WorkerState.ACTIVE
        self._idle.set()
        self._spawn(self._heartbeat_loop(), "heartbeat")
        self._spawn(self.readiness.follow(self._scripts, lambda: self.id, self.settings.heartbeat_ms), "readiness")
        self._spawn(self.weights.follow(), "control")
        self._spawn(self._idle_sweeper.run(), "idle-sweep")
        if self.settings.reap:
            self._spawn(reap_loop(self._scripts, lease_ms=lease_ms, metrics=self.metrics.fleet, clock=beats.clock,
                                  workers=lambda: beats.workers, heartbeat_ms=self.settings.heartbeat_ms), "reaper")
        if self.settings.rebalance_interval_s > 0:
            self._spawn(Rebalancer(self._scripts, lambda: self.id, self._movable, self._forget,
                                   lambda: self.state is WorkerState.ACTIVE, self.settings.rebalance_interval_s,
                                   self.settings.rebalance_threshold, lease_ms, self.metrics.fleet,
                                   lambda: beats.owned / self.settings.capacity, self._serving,
                                   self._between_steps).run(),
                        "rebalance")
        log.info("worker %s serving %s", self.id, ", ".join(self.engine.models()))

    def ready_now(self) -> tuple[bool, str]:
        """``/ready``'s answer (read in the metrics server's thread): ready once the engine is up,
        the worker registered and its heartbeats reach Redis, and its engine answers its readiness
        check; not ready while it starts, drains, or stops. Kubernetes' readiness probe asks it."""
        if self.state is not WorkerState.ACTIVE:
            return False, f"worker {self.state}"
        if not self.readiness.ready:
            return False, f"engine not ready: {self.readiness.reason}"
        if self._beat_error:
            return False, f"heartbeat failed: {self._beat_error}"
        return True, "ready"

    def request_stop(self) -> None:
        """Stop reading new jobs; :meth:`serve` then finishes in-flight jobs and returns."""
        self._stop.set()

    async def serve(self) -> None:
        """Read and run jobs until :meth:`request_stop`, then finish what was read."""
        reader = self._spawn(self._read_loop(self._stop), "reader")
        await self._stop.wait()
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout_s
        self.state = WorkerState.DRAINING
        with contextlib.suppress(Exception):
            await self._scripts_or_fail().leave_pools(self.id, pools=self._pools, state=WorkerState.DRAINING)
        await cancel_and_wait(reader)
        self.executor.stop_gate_waits()  # steps waiting for a policy version do not hold the drain
        if not await wait_set(self._idle, self.settings.drain_timeout_s):
            # Their jobs are still pending in our inbox: they move with the handover and run again
            # on the new owner; a late commit from here is refused by the epoch fence.
            log.warning("drain timeout: %d jobs still running; handing over anyway", self._active)
        if self.settings.handover_on_stop:
            self._drain = Drain(self._scripts_or_fail(), self.id, self.settings.cell_config.lease_ms,
                                self.settings.heartbeat_ms / 1000.0, self._forget, self.metrics.fleet)
            try:  # stuck sessions are served by a fresh reader (its own never-set stop) meanwhile
                await self._drain.run(deadline, lambda: self._spawn(self._read_loop(asyncio.Event()), "reader"))
            except Exception:
                log.exception("drain handover failed; sessions fail over after the lease instead")

    async def shutdown(self) -> None:
        self._stop.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a cancel of shutdown itself still lands
        await asyncio.gather(*(batcher.close() for batcher in self._batchers.values()))
        if self._results is not None:
            await self._results.close()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._scripts_or_fail().leave_pools(self.id, pools=self._pools, state=WorkerState.STOPPED)
            await self._scripts_or_fail().cancel_pending()
            await self._redis.aclose()
            self._redis = None
        await self.engine.close()
        self.metrics.close()
        self.state = WorkerState.STOPPED

    # ------------------------------------------------------------------ plumbing

    def _scripts_or_fail(self) -> Scripts:
        assert self._scripts is not None, "worker not started"
        return self._scripts

    def _redis_or_fail(self) -> Redis:
        assert self._redis is not None, "worker not started"
        return self._redis

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A task of this worker's (one per job): on the loop start() ran on, not looked up per task
        (in Python 3.11 each lookup is a getpid syscall)."""
        task = (self._loop or asyncio.get_running_loop()).create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _describe(self, state: WorkerState) -> dict[str, str]:
        models = self.engine.models()
        return {
            "state": state,
            "engine": self.engine.kind,
            "models": ",".join(models),
            "modes": ",".join(sorted({m.value for m in models.values()})),
            "capacity": str(self.settings.capacity),
            "load": str(len(self._sessions)),
            "policy_version": str(self.engine.policy_version),
            **(self.weights.fields() if self.weights else {"weights_error": ""}),  # per-model versions
            "committed_steps": str(self._executor.committed_steps if self._executor else 0),
            "idle_closed": str(self._idle_sweeper.closed if self._idle_sweeper else 0),
            "drain_stuck": str(self._drain.stuck if self._drain else 0),
            **self.readiness.fields(),
            **({"results_at": self._results.address} if self._results is not None else {}),
            READS_FIELD: READS_PACKED,  # enqueue.lua may write this worker packed inbox entries
        }

    def _beats_or_fail(self) -> Heartbeats:
        assert self._beats is not None, "worker not started"
        return self._beats

    async def _heartbeat_loop(self) -> None:
        """One beat per ``heartbeat_ms`` (half as often with no session: workers/heartbeat.py):
        mostly one command, the full heartbeat when something changed or every few beats."""
        while True:
            try:
                load = pressure(self.engine.load(), running_jobs=self._active, capacity=self.settings.capacity)
                registered = await self._beats_or_fail().beat(self.id, self._describe(self.state), load)
                if not registered and not self._stop.is_set():
                    await self._reincarnate()
                self._beat_error = ""
                await self.executor.stats.tick(self._redis_or_fail(), self.keys, self.id)
            except REDIS_ERRORS as exc:
                raise_if_cancelling()
                self._beat_error = str(exc) or type(exc).__name__
                if refusal_of(exc) is None:  # a refusal is logged once by metrics.refused
                    log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self._beats_or_fail().interval_s(serving=bool(self._sessions or self._active)))

    async def _reincarnate(self) -> None:
        """We were declared dead (paused or cut off past the lease) and our sessions moved on. Drop
        every session, and come back as a new incarnation with a new id and an empty inbox; any
        late commit of the old incarnation is refused by the epoch/owner fence."""
        old = self.id
        for session_id in list(self._sessions):
            self._forget(session_id)
        self.id = new_worker_id()
        self.settings = dataclasses.replace(self.settings, worker_id=self.id)
        self.executor.worker_id = self.id
        await self._register(self.state)
        if self._inbox_read is not None:  # a read blocked on the old inbox: read the new one now
            self._inbox_read.cancel()
        log.warning("worker %s was declared dead; re-registered as %s", old, self.id)

    async def _register(self, state: WorkerState) -> None:
        fields = self._describe(state)
        beats = self._beats_or_fail()
        now = await self._scripts_or_fail().register(
            self.id, capacity=self.readiness.offered_capacity, pools=self._pools, pool_caps=self._pool_caps,
            ttl_ms=beats.ttl_ms, fields=fields)
        beats.registered(now, fields)

    def _serving(self) -> list[Movable]:
        """Every session here whose model this worker serves, for the rebalancer."""
        models = self.engine.models()
        return [(sid, models[state.model].value, state.model) for sid, state in list(self._sessions.items())
                if state.model in models]

    def _movable(self) -> list[Movable]:
        """Sessions between steps (no job of theirs in a lane here), for the rebalancer."""
        return [session for session in self._serving() if session[0] not in self._lanes]

    async def _between_steps(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a session's lane here to empty."""
        self._lane_done.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._lane_done.wait()

    # ------------------------------------------------------------------ reading

    async def _read_loop(self, stop: asyncio.Event) -> None:
        """XREADGROUP our inbox. We start, and restart after every read error, with our own
        pending entries (cursor "0", paged): a reply lost in a Redis crash leaves entries delivered
        to us but never received, and only a history read finds them. So does a read whose
        connection failed without an error reaching us, and a job a Redis error ended here before
        its commit: every ``pending_check_s`` the next read is a history read too. Entries already
        running here are skipped."""
        redis = self._redis_or_fail()
        cursor = "0"
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        history_due = loop.time() + self.settings.pending_check_s
        while not stop.is_set():
            inbox = self.keys.inbox(self.id)  # changes when the worker re-registers as a new incarnation
            if cursor == ">" and loop.time() >= history_due:
                cursor = "0"
            if cursor == "0":
                history_due = loop.time() + self.settings.pending_check_s
            try:
                resp: Any = await self._read_inbox(redis, inbox, cursor)
                backoff.reset()
            except asyncio.CancelledError:
                raise_if_cancelling()  # the reader itself is stopping
                cursor = "0"  # a new incarnation cancelled the read of its old inbox: read the new one
                continue
            except (*REDIS_ERRORS, ResponseError) as exc:
                # ResponseError: our inbox was deleted under a blocked read (we were retired as dead);
                # the heartbeat re-registers us as a new incarnation with a new inbox.
                log.warning("inbox read failed (%s); retrying in %.2fs", exc, backoff.delay)
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    await recreate_inbox(redis, self.keys, self.id)
                await backoff.wait()
                cursor = "0"
                continue
            entries = resp[0][1] if resp else []
            if cursor != ">":
                cursor = entries[-1][0] if entries else ">"
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                if not fields or eid in self._running or self._inflight.holds(eid):  # deleted, or read already
                    continue
                await self._inflight.admit(parse_inbox_entry(entry_id, fields), self._dispatch)

    async def _read_inbox(self, redis: Redis, inbox: str, cursor: str) -> Any:
        """One XREADGROUP, blocked up to ``block_ms`` for new entries (Redis answers the moment one
        arrives), as a task a re-registration can cancel (:meth:`_reincarnate`)."""
        read = asyncio.ensure_future(redis.xreadgroup(INBOX_GROUP, self.id, {inbox: cursor},
                                                      count=self.settings.read_count, block=self.settings.block_ms))
        self._inbox_read = read
        try:
            return await read
        finally:
            self._inbox_read = None

    def _dispatch(self, job: InboxEntry | BadEntry) -> None:
        self._active += 1
        self._idle.clear()
        self._running.add(job.entry_id)
        if isinstance(job, BadEntry):
            self._spawn(self._finish(self._guard(job, reject_malformed(job, self._bad_entries)), job.entry_id), "bad")
        elif job.kind == JobKind.STEP and not job.contextual:
            self._spawn(self._finish(self._guard(job, self.executor.run_step(job, None)), job.entry_id), "stateless")
        elif job.kind == JobKind.CANCEL:  # at once, ahead of the session's queued steps (workers/fork_cancel.py)
            self._spawn(self._finish(self._guard(job, self._fork_cancel.cancel(job)), job.entry_id), "cancel")
        else:
            if job.kind == JobKind.CLOSE:  # a step waiting at the weight gate must not hold the close
                self.executor.stop_gate_waits(job.session_id)
            lane = self._lanes.get(job.session_id)
            if lane is None:
                lane = self._lanes[job.session_id] = collections.deque()
                self._spawn(self._lane(job.session_id, lane), f"lane:{job.session_id}")
            lane.append(job)

    async def _finish(self, coro: Any, entry_id: str) -> None:
        try:
            await coro
        finally:
            self._running.discard(entry_id)
            self._inflight.release()
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _lane(self, session_id: str, lane: collections.deque[InboxEntry]) -> None:
        """One session's jobs, strictly in inbox order, one at a time."""
        try:
            while lane:
                job = lane.popleft()
                await self._finish(self._guard(job, self._process(job)), job.entry_id)
        finally:
            if self._lanes.get(session_id) is lane:
                del self._lanes[session_id]
                self._lane_done.set()

    # ------------------------------------------------------------------ processing

    async def _guard(self, job: InboxEntry | BadEntry, coro: Any) -> None:
        """Run a job and answer its failure: the one place a failed job is answered. Steps, control
        jobs and malformed entries all end here as a ``StepFailed`` (a bug as an ``internal worker
        error`` like any other), answered by ``publish_failure``. A fenced job is dropped; a job
        Redis was unreachable for stays pending in this worker's inbox group, not lost. One
        coroutine for all of it: every job runs through it."""
        try:
            try:
                await coro
            except StepFailed as failure:
                await self.executor.publish_failure(job, failure, self._state_of(job))
            except (Fenced, *REDIS_ERRORS):
                raise
            except Exception:
                log.exception("job %s of session %s failed unexpectedly", job.job_id, job.session_id)
                internal = StepFailed(ErrorCode.INFERENCE_ERROR, "internal worker error", fallback=True)
                await self.executor.publish_failure(job, internal, self._state_of(job))
        except Fenced:
            await self._drop_fenced(job)
        except REDIS_ERRORS as exc:
            log.error("redis unavailable while running job %s of session %s: %s", job.job_id, job.session_id, exc)
        except Exception:
            log.exception("job %s of session %s could not be answered", job.job_id, job.session_id)

    def _state_of(self, job: InboxEntry | BadEntry) -> SessionState | None:
        """The session state a failure reports its committed step from (none for a stateless step)."""
        if isinstance(job, BadEntry) or (job.kind == JobKind.STEP and not job.contextual):
            return None
        return self._sessions.get(job.session_id)

    async def _process(self, job: InboxEntry) -> None:
        state = await self._session_state(job)
        if job.kind in (JobKind.STEP, JobKind.FORK):
            await (self.executor.run_step(job, state) if job.kind == JobKind.STEP
                   else self._fork_cancel.fork(job, state))
            return

        async def apply_once() -> None:
            await self.executor.jobs.apply_control(job)  # raises Fenced before the engine is touched
            if job.kind == JobKind.CLOSE:
                self._forget(job.session_id)
            else:
                self.engine.drop_session(job.session_id)
                state.committed = -1
                state.engine_ready = True  # an empty context: the next step starts fresh (reset=True)

        await settled(apply_once, f"{job.kind} {job.session_id}")

    async def _session_state(self, job: InboxEntry) -> SessionState:
        """This worker's view of the job's session at the job's epoch; read from Redis when the
        session is new here or its epoch moved (a failover in or out). Raises Fenced for a job of
        a session this worker does not own at that epoch."""
        state = self._sessions.get(job.session_id)
        if state is not None and state.epoch == job.epoch:
            return state
        raw: Any = await until_redis_answers(lambda: resolve(self._redis_or_fail().hgetall(
            self.keys.session(job.session_id))), "session state")
        session = SessionHash.from_fields(raw) if raw else None
        if session is None or session.owner != self.id or session.epoch != job.epoch:
            raise Fenced(job.session_id)
        # A new epoch means the engine's context (if any) may be stale: rebuild before the next step.
        self.engine.drop_session(job.session_id)
        state = SessionState(committed=session.committed_step_id, epoch=job.epoch, model=session.model,
                             max_staleness=session.max_staleness)
        self._sessions[job.session_id] = state
        return state

    async def _drop_fenced(self, job: InboxEntry | BadEntry) -> None:
        """A job the session hash fences off is acked and dropped; the session's context goes only
        when Redis says it is no longer ours at the epoch we hold (see FencedEntries in workers/job_scripts.py)."""
        assert isinstance(job, InboxEntry)  # only a parsed job has an epoch to be fenced on
        assert self._fenced is not None, "worker not started"
        state = self._sessions.get(job.session_id)
        if not await self._fenced.drop(job, state.epoch if state else None):
            self._forget(job.session_id)

    def _forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        if self._idle_sweeper is not None:
            self._idle_sweeper.forget(session_id)
        self.engine.drop_session(session_id)
        self.engine.drop_session(f"{session_id}:stateless")
