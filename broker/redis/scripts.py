"""Lua scripts shipped beside this module, each with one small typed wrapper.

Scripts are registered once per client (EVALSHA, reloaded on NOSCRIPT by redis-py). Every key a
script can be told before it runs is passed in KEYS and built by :mod:`broker.redis.keys`; the few
a script derives from a KEYS entry (a step the script reads) are listed in docs/architecture.md,
"Keys in Lua scripts". No key, nor key prefix, goes in ARGV (tests/test_lua_scripts.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from broker.redis.admission import Admission
from broker.redis.aio import HeldFuture, drop, outcome_of, settle
from broker.redis.blobs import BLOB_MARK, STAGE_BYTES, after_command, stage_command, stored_resolved, unless_unstaged
from broker.redis.cells import touch_cell
from broker.redis.connect import cluster_client_errors
from broker.redis.durability import ReplicaWait, call_then_wait
from broker.redis.inputs import enqueue_staging, stages
from broker.redis.keys import INBOX_GROUP, CellKeys
from broker.redis.layouts import (
    DEAD_LETTER_MAXLEN,
    DEAD_LETTER_PAYLOAD_BYTES,
    DEFAULT_REPLY_BOUNDS,
    ReplyBounds,
    handled_field,
)
from broker.redis.lua_files import PRELUDE_MARK as PRELUDE_MARK
from broker.redis.lua_files import lua_file as lua_file
from broker.redis.lua_files import lua_source as lua_source
from broker.redis.refusals import RedisRefused, as_refused, refusal_of
from broker.redis.script_replies import (
    ApplyControlReply,
    CancelReply,
    CommitReply,
    ControlReply,
    CreateReply,
    EnqueueReply,
    FailoverReply,
    ForkReply,
    Heartbeat,
    IdleReply,
    ReportReply,
    RetireReply,
    decode_apply_control,
    decode_cancel,
    decode_close_idle,
    decode_commit,
    decode_control,
    decode_create,
    decode_enqueue,
    decode_failover,
    decode_fork,
    decode_heartbeat,
    decode_integer,
    decode_report,
    decode_retire,
)
from schemas.records import quick_init

RETIRE_TRIES = 5  # retire.lua calls while entries keep reaching the inbox between the read and the call
BATCHED = frozenset({"commit", "enqueue"})  # scripts whose coalesced calls run as one call (run_batch)
BATCH_MARK = "\0batch"  # prelude.lua BATCH_MARK: ARGV[1] of a batch call


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


_Pending = tuple[str, list[str], list[Any], "asyncio.Future[Any]", list[Any] | None]  # before: a staging SET


def _runs(batch: list[_Pending]) -> list[list[_Pending]]:
    """The batch cut into runs: consecutive calls of one script in ``BATCHED`` with as many KEYS and
    as many ARGV share a run; every other call is a run of its own. Calls keep their order."""
    runs: list[list[_Pending]] = []
    for pending in batch:
        if runs and pending[0] in BATCHED and _same_shape(runs[-1][0], pending):
            runs[-1].append(pending)
        else:
            runs.append([pending])
    return runs


def _same_shape(first: _Pending, pending: _Pending) -> bool:
    return first[0] == pending[0] and len(first[1]) == len(pending[1]) and len(first[2]) == len(pending[2])


def _batch_layout(run: list[_Pending]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one batch call (prelude.lua run_batch): the calls' shape once, the longest
    run of trailing ARGV equal in every call once, then each call's own ARGV. A position's values
    come from one line of one caller, so they have one type (no 1 beside 1.0, which encode apart)."""
    columns = list(zip(*(call_args for _, _, call_args, _, _ in run), strict=True))
    count, nargs = len(run), len(columns)
    shared = 0
    while shared < nargs and columns[nargs - 1 - shared].count(columns[nargs - 1 - shared][0]) == count:
        shared += 1
    own = nargs - shared
    keys: list[str] = []
    args: list[Any] = [BATCH_MARK, count, len(run[0][1]), own, shared, *run[0][2][own:]]
    for _, call_keys, call_args, _, _ in run:
        keys += call_keys
        args += call_args[:own]
    return keys, args


@quick_init
@dataclass(frozen=True)
class CommitCall:
    """One call of commit.lua: commit step ``step_id`` of ``session_id`` for the job ``job_id``
    (inbox entry ``entry_id``) that ``worker_id`` ran under lease ``epoch``, and publish ``result``
    to ``reply_to`` (kept ``reply_ttl_ms``; an empty ``result`` only re-publishes a stored one).

    ``record`` (kept per ``keep_records``: -1 all, N the last N, 0 none) is what a new owner replays
    to rebuild the session's context. ``deferred``: commit without publishing (see
    :meth:`Scripts.commit_and_wait`); a later call with an empty result publishes. ``version``: the
    policy version the step ran on (a session with max_staleness records its first one).
    ``cancels``: the job's cancel count; a step of a session cancelled since then does not commit
    (None: unchecked). A result of ``Scripts.stage_bytes`` or more is staged
    (broker/redis/blobs.py). ``input_staged``: the job's payload was staged
    (broker/redis/inputs.py); its blob becomes the record's or goes."""

    session_id: str
    worker_id: str
    epoch: int
    step_id: int
    entry_id: str
    result: bytes
    context_length: int
    job_id: str
    reply_to: str
    reply_ttl_ms: int
    record: bytes = b""
    keep_records: int = -1
    reply_bounds: ReplyBounds = DEFAULT_REPLY_BOUNDS
    deferred: bool = False
    version: int | None = None
    cancels: int | None = None
    input_staged: bool = False


class Scripts:
    """Typed calls of the cell's Lua scripts on one Redis connection pool."""

    NAMES = (
        "create", "enqueue", "control", "commit", "report", "apply_control",
        "register", "heartbeat", "leave_pools", "failover", "retire", "ack_result", "close_idle",
        "set_capacity", "unplaced", "announce", "cancel", "fork", "snapshot",
    )
    stage_bytes = STAGE_BYTES  # results of this size or more are staged (bench.result_blobs varies it)

    def __init__(self, redis: Redis, keys: CellKeys, *, coalesce: bool = True,
                 sources: dict[str, str] | None = None) -> None:
        """``sources``: script sources by name to run instead of this checkout's (bench.step_scripts
        runs another revision's Lua through the same calls)."""
        self.redis = redis
        self.keys = keys
        self.coalesce = coalesce
        chosen = sources or {}
        self._scripts = {name: redis.register_script(chosen.get(name) or lua_source(name)) for name in self.NAMES}
        self._pending: list[_Pending] = []
        self._flushing: set[asyncio.Task[None]] = set()
        # Told of every refused call (broker/redis/refusals.py): a worker counts and logs them.
        self.on_refusal: Callable[[RedisRefused], None] | None = None
        self.refused_at = float("-inf")  # time.monotonic() of the last refusal seen

    async def _call(self, name: str, keys: list[str], args: list[Any], before: list[Any] | None = None, *,
                    hold_cancel: bool = False) -> Any:
        """One script call; a refusal (OOM, MISCONF, READONLY, ...) is raised as
        :class:`RedisRefused`, the connection error callers already ride out. ``hold_cancel``: a
        coalesced call's answer is waited for even if the caller is cancelled meanwhile
        (``outcome_of``)."""
        try:
            return await self._coalesced(name, keys, args, before, hold_cancel)
        except ResponseError as exc:
            raise self._refused(exc) from exc

    def _refused(self, exc: ResponseError) -> Exception:
        refused = as_refused(exc)
        if isinstance(refused, RedisRefused):
            self.note_refusal(refused)
        return refused

    def note_refusal(self, refused: RedisRefused) -> None:
        """Record a refusal seen on this connection pool (by a script call or a plain command)."""
        self.refused_at = time.monotonic()
        if self.on_refusal is not None:
            self.on_refusal(refused)

    def refused_within(self, seconds: float) -> bool:
        """Whether Redis refused a write on this pool in the last ``seconds``."""
        return time.monotonic() - self.refused_at < seconds

    async def _coalesced(self, name: str, keys: list[str], args: list[Any], before: list[Any] | None,
                         hold_cancel: bool = False) -> Any:
        """Script calls made in the same event-loop turn (many lanes committing, many sessions
        enqueueing) leave as one pipeline: one write and one read instead of one per call.
        Calls keep their order; each caller gets its own result or error."""
        if not self.coalesce:
            return await self._direct(name, keys, args, before)
        if self._pending:  # the loop is the batch's, looked up once a batch: in Python 3.11 a getpid syscall
            loop = self._pending[0][3].get_loop()
        else:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._flush_soon, loop)  # after the callbacks already ready: they join this batch
        if hold_cancel:
            held: HeldFuture[Any] = HeldFuture(loop=loop)
            self._pending.append((name, keys, args, held, before))
            return await outcome_of(held)
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((name, keys, args, fut, before))
        return await fut

    async def _direct(self, name: str, keys: list[str], args: list[Any], before: list[Any] | None = None) -> Any:
        if before is not None:
            return await after_command(self.redis, before, self._scripts[name], keys, args)
        return await self._scripts[name](keys=keys, args=args)  # EVALSHA, loads on NOSCRIPT

    async def cancel_pending(self) -> None:
        """Cancel the script calls still in flight, before the owner closes the connection pool:
        a flush that outlived its pool would open a fresh connection nobody closes. Their callers
        see a cancellation (a commit that was sent is fenced like any lost reply)."""
        batch, self._pending = self._pending, []
        for _, _, _, fut, _ in batch:
            drop(fut)
        for task in list(self._flushing):
            task.cancel()
        await asyncio.gather(*self._flushing, return_exceptions=True)

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if not batch:  # cancelled before the loop came round to flush it
            return
        task = asyncio.create_task(self._flush(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    def _as_redis_error(self, exc: Exception) -> Exception:
        """A cluster pipeline's failover quirk (``cluster_client_errors``) is retried as the
        connection error it is."""
        if isinstance(exc, cluster_client_errors(self.redis)):
            return RedisConnectionError(f"cluster client learning its nodes again: {exc}")
        return exc

    async def _flush(self, batch: list[_Pending]) -> None:
        try:
            await self._flush_batch(batch)
        finally:  # cancelled (cancel_pending): a caller holding its cancellation must not wait for ever
            for pending in batch:
                if not pending[3].done():
                    drop(pending[3])

    async def _flush_batch(self, batch: list[_Pending]) -> None:
        if len(batch) == 1:  # nothing to coalesce: the plain call
            name, keys, args, fut, before = batch[0]
            await settle(fut, self._direct(name, keys, args, before))
            return
        try:
            results = await self._pipelined(batch)
        except Exception as exc:  # the connection failed: every caller sees it, as it would alone
            exc = self._as_redis_error(exc)
            for pending in batch:
                if not pending[3].done():
                    pending[3].set_exception(exc)
            return
        for (name, keys, args, fut, before), result in zip(batch, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, NoScriptError):  # not loaded on this server yet: the plain call loads it
                await settle(fut, self._direct(name, keys, args, before))
            elif isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    async def _pipelined(self, batch: list[_Pending]) -> list[Any]:
        """One pipeline of the batch's calls: each script's reply or error, in the batch's order.
        A run of consecutive calls of one batched script (commits, enqueues) is one script call
        (prelude.lua run_batch): fewer script runs and one XACK, XDEL and TIME per run instead of
        one per step. Staging SETs go first; a staging SET's reply is skipped: had it failed, its
        script answers 'unstaged'."""
        runs = _runs(batch)
        async with self.redis.pipeline(transaction=False) as pipe:
            for run in runs:
                for *_, before in run:
                    if before is not None:
                        pipe.execute_command(*before)
                name = run[0][0]
                keys, args = _batch_layout(run) if len(run) > 1 else (run[0][1], run[0][2])
                pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
            replies = iter(await pipe.execute(raise_on_error=False))
        results: list[Any] = []
        for run in runs:
            for *_, before in run:
                if before is not None:
                    next(replies)
            reply = next(replies)
            if len(run) == 1:
                results.append(reply)
            elif isinstance(reply, Exception):  # the whole call failed (NOSCRIPT, a refusal): each sees it
                results += [reply] * len(run)
            elif isinstance(reply, list) and len(reply) == len(run):
                results += reply
            else:
                results += [ResponseError(f"batched {run[0][0]} answered {reply!r:.200}")] * len(run)
        return results

    # ------------------------------------------------------------------ trainer side

    async def create(self, session_id: str, mode: str, model: str, *, lease_ms: int, retention: str,
                     result_window: int, idle_timeout_ms: int = 0, max_staleness: int | None = None,
                     admission: Admission | None = None, priority: str = "bulk",
                     trainer: str = "default") -> CreateReply:
        """``idle_timeout_ms``: its owner closes the session after that long unused (0: never).
        ``max_staleness``: the session's staleness bound (None: none); ``admission``: count the
        session against a producer's admission bound (docs/async_rl.md). ``trainer``: whose open
        sessions it counts in (refused over that trainer's cap)."""
        k = self.keys
        keys = [k.workers, k.capacity, k.pool(mode, model), k.session(session_id), k.sessions, k.owned, k.pressure,
                k.announced, k.trainer_caps, k.trainer_open]
        args: list[Any] = [session_id, mode, model, lease_ms, retention, result_window, idle_timeout_ms,
                           "" if max_staleness is None else max_staleness, priority, trainer]
        if admission is not None:
            keys.append(k.admission(admission.name))
            args += [admission.batch_size, admission.max_offpolicyness, admission.name]
        return decode_create(await self._call("create", keys, args))

    async def enqueue(self, session_id: str, owner: str, *, step_id: int, contextual: bool, job_id: str,
                      reply_to: str, payload: bytes, attempt: int = 0, min_version: int = 0) -> EnqueueReply:
        k = self.keys
        keys, before = [k.session(session_id), k.inbox(owner), k.log(session_id), k.announced, k.worker(owner)], None
        if stages(payload, self.stage_bytes):  # broker/redis/inputs.py
            staging, before = enqueue_staging(k, session_id, job_id, payload)
            keys, payload = keys + staging, b""
        raw = await self._call("enqueue", keys, [step_id, job_id, payload, session_id, owner, attempt, min_version,
                                                 "1" if contextual else "0", reply_to], before)
        return await stored_resolved(self.redis, decode_enqueue(unless_unstaged(raw)),
                                     session_key=k.session(session_id), step_id=step_id)

    async def control(self, session_id: str, owner: str, *, kind: str, job_id: str,
                      reply_to: str) -> ControlReply:
        k = self.keys
        raw = await self._call(
            "control", [k.session(session_id), k.inbox(owner)], [owner, kind, job_id, reply_to, session_id]
        )
        return decode_control(raw)

    async def announce(self, fields: dict[str, str], *, model: str, version: int, maxlen: int) -> str:
        """Add a weight update to the control stream and raise the model's announced version (only
        ever up), in one script; the entry's id."""
        k = self.keys
        flat = [item for pair in fields.items() for item in pair]
        raw = await self._call("announce", [k.control, k.announced], [model, version, maxlen, *flat])
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    async def cancel(self, session_id: str, owner: str) -> CancelReply:
        k = self.keys
        return decode_cancel(await self._call("cancel", [k.session(session_id), k.inbox(owner)], [owner, session_id]))

    async def fork(self, session_id: str, owner: str, *, mode: str, model: str, branches: list[str]) -> ForkReply:
        """Branch ``session_id`` into the new sessions ``branches`` on its owner (fork.lua)."""
        k = self.keys
        keys = [k.session(session_id), k.log(session_id), k.sessions, k.owned, k.capacity, k.pool(mode, model),
                k.inbox(owner), k.trainer_caps, k.trainer_open]
        for branch in branches:
            keys += [k.session(branch), k.log(branch)]
        return decode_fork(await self._call("fork", keys, [owner, session_id, *branches]))

    async def ack_result(self, *, stream: str, group: str, entry_id: str, session_id: str, step_id: int,
                         handled_ttl_ms: int) -> bool:
        k = self.keys
        raw = await self._call("ack_result", [k.reply(stream), k.handled(stream, group)],
                               [group, entry_id, handled_field(session_id, step_id), handled_ttl_ms])
        return bool(decode_integer("ack_result", raw))

    # ------------------------------------------------------------------ worker side

    async def commit(self, call: CommitCall, *, hold_cancel: bool = False) -> CommitReply:
        """Commit a step (what each field means: :class:`CommitCall`); ``hold_cancel``: see :meth:`_call`."""
        keys, args, before = self._commit_call(call)
        return decode_commit(unless_unstaged(await self._call("commit", keys, args, before, hold_cancel=hold_cancel)))

    async def commit_and_wait(self, call: CommitCall, wait: ReplicaWait) -> tuple[CommitReply, int]:
        """``call`` deferred (an empty ``result``: a deferred duplicate) followed by ``WAIT`` on the
        same connection, never coalesced with other calls: the reply and how many replicas have the
        commit. Nothing is published until :meth:`commit` with ``result=b""`` runs after it."""
        keys, args, before = self._commit_call(dataclasses.replace(call, deferred=True))
        command = ["EVALSHA", self._scripts["commit"].sha, len(keys), *keys, *args]
        raw, acked = await call_then_wait(self.redis, keys[0], command, wait, before)
        if isinstance(raw, NoScriptError):  # a master that never ran it (a promoted replica): load, again
            await self.redis.script_load(lua_source("commit"))
            raw, acked = await call_then_wait(self.redis, keys[0], command, wait, before)
        if isinstance(raw, ResponseError) and refusal_of(raw) is not None:
            raise self._refused(raw) from raw
        return decode_commit(unless_unstaged(raw)), acked

    def _commit_call(self, c: CommitCall) -> tuple[list[str], list[Any], list[Any] | None]:
        """commit.lua's KEYS and ARGV (in the order its header names them), and the staging SET of a
        large result to pipeline before it."""
        k = self.keys
        keys = [k.session(c.session_id), k.log(c.session_id), k.inbox(c.worker_id), k.reply(c.reply_to),
                k.reply_blob(c.reply_to, c.job_id)]
        staged = len(c.result) >= self.stage_bytes
        before = None
        if staged or c.keep_records > 0 or c.input_staged:  # the keys only these calls touch (commit.lua)
            stage = k.staged_result(c.session_id, c.step_id, c.worker_id, c.epoch)
            before = stage_command(stage, c.result) if staged else None
            keys += [stage, k.result_blob(c.session_id, c.step_id),
                     k.record_blob(c.session_id, c.step_id - c.keep_records)]
        if c.input_staged:
            keys += [k.input_blob(c.session_id, c.job_id), k.record_blob(c.session_id, c.step_id)]
        return (
            keys,
            [c.step_id, c.entry_id, c.job_id, b"" if before else c.result, c.context_length, c.record, c.epoch,
             "" if c.cancels is None else c.cancels, "1" if before else "", "" if c.version is None else c.version,
             "1" if c.deferred else "0", c.keep_records, c.reply_ttl_ms, *c.reply_bounds.args(), INBOX_GROUP,
             c.worker_id],
            before,
        )

    async def report(self, *, session_id: str, worker_id: str, epoch: int, entry_id: str, job_id: str,
                     result: bytes, fallback_gen: int | None, reply_to: str, reply_ttl_ms: int,
                     dead_letter: dict[str, Any] | None = None,
                     reply_bounds: ReplyBounds = DEFAULT_REPLY_BOUNDS) -> ReportReply:
        """Publish a non-committing outcome; ``dead_letter`` fields also dead-letter the job."""
        k = self.keys
        flat = [item for pair in (dead_letter or {}).items() for item in pair]
        keys = [k.session(session_id), k.inbox(worker_id), k.reply(reply_to), k.dead, k.input_blob(session_id, job_id)]
        before = None
        if len(result) >= self.stage_bytes:  # a large stateless result: staged as a commit's is
            keys += [k.staged_reply(reply_to, job_id, worker_id), k.reply_blob(reply_to, job_id)]
            before, result = stage_command(keys[5], result), b""
        raw = await self._call(
            "report", keys,
            [worker_id, epoch, entry_id, job_id, result, "" if fallback_gen is None else fallback_gen,
             reply_ttl_ms, INBOX_GROUP, DEAD_LETTER_MAXLEN, *reply_bounds.args(), *flat], before)
        return decode_report(unless_unstaged(raw))

    async def failover(self, *, session_id: str, mode: str, model: str, old: str, new: str, lease_ms: int,
                       reason: str) -> FailoverReply:
        k = self.keys
        raw = await self._call(
            "failover",
            [k.workers, k.capacity, k.pool(mode, model), k.session(session_id), k.inbox(old), k.inbox(new),
             k.sessions, k.owned, k.worker(new)],
            [old, new, lease_ms, session_id, reason, INBOX_GROUP],
        )
        return decode_failover(raw)

    async def retire(self, worker_id: str, *, pools: list[str], lease_ms: int, reason: str) -> RetireReply:
        """Retire ``worker_id`` (retire.lua). The script is given every key it touches: the input
        blobs of the inbox's staged entries are read here first, and an entry staged since (the
        script answers 'unlisted' before any write) sends the call round again."""
        k = self.keys
        raw: Any = None
        for _ in range(RETIRE_TRIES):
            staged = await self._staged_entries(worker_id)
            raw = await self._call(
                "retire",
                [k.workers, k.capacity, k.worker(worker_id), k.inbox(worker_id), k.dead, k.owned, k.pressure, *pools,
                 *staged.values()],
                [worker_id, lease_ms, reason, DEAD_LETTER_MAXLEN, DEAD_LETTER_PAYLOAD_BYTES, len(pools), *staged],
            )
            if not (isinstance(raw, list) and raw and raw[0] in (b"unlisted", "unlisted")):
                break
        return decode_retire(raw)  # after RETIRE_TRIES 'unlisted' answers: a ScriptError that says so

    async def _staged_entries(self, worker_id: str) -> dict[str, str]:
        """The inbox entries of ``worker_id`` whose payload was staged: entry id -> its input blob."""
        k = self.keys
        staged: dict[str, str] = {}
        for entry_id, fields in await self.redis.xrange(k.inbox(worker_id)):
            if fields.get(b"payload") == BLOB_MARK:
                session_id, job_id = (_text(fields.get(name, b"")) for name in (b"session_id", b"job_id"))
                staged[_text(entry_id)] = k.input_blob(session_id, job_id)
        return staged

    async def apply_control(self, *, session_id: str, worker_id: str, epoch: int, entry_id: str,
                            job_id: str, kind: str, mode: str, model: str, reply_to: str,
                            grace_ms: int, reply_ttl_ms: int, closed_retention_ms: int | None = None,
                            reply_bounds: ReplyBounds = DEFAULT_REPLY_BOUNDS) -> ApplyControlReply:
        """``closed_retention_ms``: how long a closed session's hash answers status (None: ``grace_ms``)."""
        k = self.keys
        raw = await self._call(
            "apply_control",
            [k.session(session_id), k.log(session_id), k.inbox(worker_id), k.reply(reply_to),
             k.pool(mode, model), k.sessions, k.owned, k.trainer_open],
            [worker_id, epoch, entry_id, job_id, kind, grace_ms, reply_ttl_ms, INBOX_GROUP, session_id,
             *reply_bounds.args(), grace_ms if closed_retention_ms is None else closed_retention_ms],
        )
        return decode_apply_control(raw)

    async def register(self, worker_id: str, *, capacity: int, pools: list[str], ttl_ms: int,
                       fields: dict[str, str], pool_caps: dict[str, int] | None = None) -> int:
        """``capacity`` bounds the worker's sessions over all ``pools``; ``pool_caps`` (pool key ->
        cap) bounds one pool's share where the engine splits its capacity by model."""
        k = self.keys
        flat = [item for pair in fields.items() for item in pair]
        caps = [str((pool_caps or {}).get(pool, "")) for pool in pools]
        raw = await self._call(
            "register",
            [k.workers, k.capacity, k.worker(worker_id), k.inbox(worker_id), k.pool_index, k.owned, k.pressure,
             *pools],
            [worker_id, capacity, ttl_ms, INBOX_GROUP, *caps, *flat],
        )
        now = decode_integer("register", raw)
        await touch_cell(self.redis, k, now)  # clients find the cell in the deployment's registry
        return now

    async def heartbeat(self, worker_id: str, *, ttl_ms: int, fields: dict[str, str],
                        pressure: float | None = 0.0, touch: bool = True) -> Heartbeat:
        """The full heartbeat (heartbeat.lua). ``pressure``: the engine's load signal in [0, 1] that
        placement adds to the session share (None: unchanged); ``fields``: the worker hash's fields
        to write (a worker sends the ones that changed). ``touch``: raise the cell's score in the
        deployment's registry too (a worker paces that on its own: workers/heartbeat.py)."""
        k = self.keys
        flat = [item for pair in fields.items() for item in pair]
        level = "" if pressure is None else f"{min(1.0, max(0.0, pressure)):.4f}"
        raw = await self._call("heartbeat", [k.workers, k.worker(worker_id), k.pressure, k.owned],
                               [worker_id, ttl_ms, level, *flat])
        beat = decode_heartbeat(raw)
        if beat.registered and touch:
            await touch_cell(self.redis, k, beat.now_ms)
        return beat

    async def mark_unplaced(self, session_id: str, *, owner: str) -> bool:
        """Mark a session of ``owner`` that no live worker could take; False when it moved or is gone."""
        raw = await self._call("unplaced", [self.keys.session(session_id)], [owner])
        return decode_integer("unplaced", raw) == 1

    async def close_idle(self, session_id: str, *, worker_id: str) -> IdleReply:
        """Close the session if it has been idle past its timeout: ``IdleClosed`` (how long it was
        idle), or ``IdleKept`` (in use, not idle yet, without a timeout, not ours, or closed)."""
        raw = await self._call("close_idle", [self.keys.session(session_id), self.keys.inbox(worker_id)],
                               [worker_id, session_id])
        return decode_close_idle(raw)

    async def save_snapshot(self, session_id: str, *, worker_id: str, epoch: int, step_id: int, gen: int,
                            snapshot: bytes) -> bool:
        """Store the session's context snapshot taken after committed ``step_id``; False when
        refused (fenced, reset or closed since, step not committed)."""
        raw = await self._call("snapshot", [self.keys.session(session_id), self.keys.log(session_id)],
                               [worker_id, epoch, step_id, gen, snapshot])
        return decode_integer("snapshot", raw) == 1

    async def set_capacity(self, worker_id: str, capacity: int, *, fields: dict[str, str]) -> bool:
        """A registered worker's capacity (0: no new sessions) and the fields that say why; False
        when it is not registered."""
        flat = [item for pair in fields.items() for item in pair]
        raw = await self._call("set_capacity", [self.keys.capacity, self.keys.worker(worker_id)],
                               [worker_id, capacity, *flat])
        return decode_integer("set_capacity", raw) == 1

    async def leave_pools(self, worker_id: str, *, pools: list[str], state: str) -> None:
        await self._call("leave_pools", [self.keys.worker(worker_id), *pools], [worker_id, state])
