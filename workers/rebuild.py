"""Context rebuild: a new owner rebuilds a session's engine context from its committed step records.

The records themselves (written with each commit), their output digests and the snapshots of
engine contexts live here too: they exist for the rebuild and are read by it alone.

Each committed step leaves a record: its input payload, a digest of its output, the policy version
that produced it, the context length after it and, for token steps, the generated token ids. A
payload that was staged (broker/redis/inputs.py) is the mark in the record and its bytes are in the
step's record blob, read back in one round trip with the records.

- A token session's context is its token ids, all recorded: one request of every step's input ids
  and generated ids, in order, generating nothing (``max_tokens=0``), rebuilds it in one prefill,
  checked by context length; whatever weights produced the steps. Steps with multimodal inputs
  are replayed one by one instead (their features are not token ids).
- A session whose engine exported snapshots (snapshots, below) restores the latest usable one
  and replays only the steps after it; without one, every step is replayed.
- A replay of records produced by the weights this engine runs now rebuilds the context exactly;
  every replayed output must match its digest, so a wrong context is caught before it produces a
  wrong commit. Records produced by other weights (a weight update since, or a partial rollout's
  step continued across one: ``first_version``) replay teacher-forced by context length (tokens).
  A world-model step produced by other weights of the same model cannot be replayed
  (the model's state under the old weights is gone): the rebuild fails with CONTEXT_LOST and says
  why (reset the session). Each model's version counts on its own: an update of another model's
  weights does not touch a world session's records.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import xxhash
from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.inbox import InboxEntry
from broker.redis.inputs import InputGone, read_record_inputs
from broker.redis.keys import CellKeys
from broker.redis.layouts import LOG_SNAPSHOT_FIELD, log_input_field
from broker.redis.scripts import Scripts
from schemas.codec import decode, encode, encode_plain
from schemas.errors import ContextLost, FleetError, StepAborted
from schemas.messages import Mode, SamplingParams, StepInput, TokenStep, parse_step_input
from workers.batcher import Batcher
from workers.engines.base import Engine, EngineRequest

log = logging.getLogger(__name__)
VERSIONS_KEY = "weight_versions"  # per token: the policy version (workers.executor.Continuation)


def first_version(output: Mapping[str, Any], version: int) -> int:
    """The oldest policy version among a step's tokens (``version`` when it reports none)."""
    versions = output.get(VERSIONS_KEY)
    return min(int(v) for v in versions) if versions else version


# ------------------------------------------------------------------ output digests
# Output digests: the fingerprint of a step's output kept in its step record, which a new owner
# checks its replay against (the rebuild, below). Not a security boundary: a replay is compared with
# what the same engine produced before, so a fast non-cryptographic hash is enough.
#
# A record names the hash that made its digest (``digest_kind``). New records use xxh3-128: a 450 KB
# latent hashes in about 5 µs, where blake2b took 325 µs (a quarter of a latent step's round trip,
# docs/benchmarks.md). Records without the field were written by earlier releases with blake2b-16;
# they stay checkable, so a session committed before an upgrade rebuilds after it.


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


XXH3_128 = "xxh3-128"
BLAKE2B_16 = "blake2b-16"  # records without a digest_kind (earlier releases)
DIGEST_KIND = XXH3_128  # what new records get
_HASHERS: dict[str, Callable[[], _Hasher]] = {
    XXH3_128: xxhash.xxh3_128,
    BLAKE2B_16: lambda: hashlib.blake2b(digest_size=16),
}


def output_digest(output: Mapping[str, Any], kind: str = DIGEST_KIND) -> bytes:
    """A fingerprint of a step's output: arrays are hashed in place, so a latent is read once and
    never re-encoded. ``weight_versions`` is left out: the worker adds it to the engine's output,
    and a replay compares the engine's alone."""
    new = _HASHERS.get(kind)
    if new is None:
        raise ContextLost(f"the step record's digest is of an unknown kind {kind!r}; this worker "
                          f"checks {', '.join(sorted(_HASHERS))}")
    h = new()
    for key in sorted(output):
        if key == VERSIONS_KEY:
            continue
        value = output[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(_array_head(value))
            h.update(value if value.flags.c_contiguous else np.ascontiguousarray(value))  # its bytes, as laid out
        else:
            h.update(encode_plain(value))  # not the frame: a digest must survive a change of framing
    return h.digest()


_HEADS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def _array_head(value: np.ndarray[Any, Any]) -> bytes:
    """What a digest hashes before an array's bytes: its dtype and shape as text (a step's arrays
    keep theirs from step to step, so the text is made once per dtype and shape)."""
    key = (value.dtype.str, value.shape)
    head = _HEADS.get(key)
    if head is None:
        head = f"{key[0]}{key[1]}".encode()
        if len(_HEADS) < 1024:
            _HEADS[key] = head
    return head


def record_digest_kind(record: Mapping[str, Any]) -> str:
    """The hash that made a step record's digest."""
    kind = record.get("digest_kind", BLAKE2B_16)
    return kind if isinstance(kind, str) else repr(kind)


# ------------------------------------------------------------------ snapshots
# Snapshots of engine contexts: a session's context, saved every N committed steps, lets a new owner
# restore it and replay at most N steps instead of every step of the session.
#
# Only engines that can export a session's context take part (``Engine.export_session``; the
# reference world model can); token sessions need none (their context is rebuilt from the recorded
# tokens in one prefill, below). A snapshot lives in the session's log hash
# (``LOG_SNAPSHOT_FIELD``, written by snapshot.lua only after the step's commit) as a msgpack map:
#
# - ``step``: the committed step it follows; ``gen``: the session's gen when it was taken;
# - ``state``: the engine's export, zlib-compressed; ``digest``: blake2b of ``state`` as stored;
# - ``output``: the digest of that step's output, checked against its step record when one is kept.
#
# Restoring checks all of these; a snapshot that fails a check is ignored with a warning, and the
# context is rebuilt by a full replay as before.

MAX_STATE_BYTES = 1 << 30  # a decompressed state larger than this is refused, not allocated
_THREAD_BYTES = 1 << 16  # states this large are compressed off the event loop


class SnapshotError(ValueError):
    """A stored snapshot that cannot be used (corrupt, truncated, of another format)."""


@dataclass(frozen=True)
class Snapshot:
    step: int
    gen: int
    state: bytes  # the engine's export, decompressed and digest-checked
    output: bytes  # the digest of the step's output (workers.rebuild.output_digest)


def state_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def pack(step: int, gen: int, state: bytes, output: bytes) -> bytes:
    compressed = zlib.compress(state, 1)
    return encode({"step": step, "gen": gen, "state": compressed, "digest": state_digest(compressed),
                   "output": output})


def unpack(raw: bytes) -> Snapshot:
    """The snapshot in ``raw``; SnapshotError when any check fails."""
    try:
        fields: Mapping[str, Any] = decode(raw)
        compressed, digest = fields["state"], fields["digest"]
        step, gen, output = fields["step"], fields["gen"], fields["output"]
    except (FleetError, KeyError, TypeError) as exc:
        raise SnapshotError(f"unreadable: {exc}") from exc
    if not all(isinstance(v, bytes) for v in (compressed, digest, output)) \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, gen)):
        raise SnapshotError("fields of the wrong types")
    if state_digest(compressed) != digest:
        raise SnapshotError("its digest does not match its state")
    try:
        inflate = zlib.decompressobj()
        state = inflate.decompress(compressed, MAX_STATE_BYTES)
    except zlib.error as exc:
        raise SnapshotError(f"cannot decompress: {exc}") from exc
    if inflate.unconsumed_tail or not inflate.eof:
        raise SnapshotError(f"its state is truncated or larger than {MAX_STATE_BYTES} bytes")
    return Snapshot(step=step, gen=gen, state=state, output=output)


async def load_snapshot(redis: Redis, keys: CellKeys, session_id: str, *, gen: int,
                        committed: int) -> Snapshot | None:
    """The session's usable snapshot, or None (no snapshot, or one that fails a check: warned)."""
    raw: Any = await resolve(redis.hget(keys.log(session_id), LOG_SNAPSHOT_FIELD))
    if raw is None:
        return None
    try:
        snapshot = unpack(raw)
    except SnapshotError as exc:
        log.warning("the snapshot of %s is unusable (%s); replaying every step", session_id, exc)
        return None
    # Only a reset makes a snapshot stale, and a reset drops the log with it; snapshot.lua refuses
    # a write for an older gen. A step fallback moves the gen on too, but keeps the committed
    # steps, and the snapshot with them. So one gen at most as new as the job's is good.
    if snapshot.gen > gen or snapshot.step > committed:
        log.warning("the snapshot of %s (gen %d, step %d) does not match the session (gen %d, committed %d); "
                    "replaying every step", session_id, snapshot.gen, snapshot.step, gen, committed)
        return None
    return snapshot


class Snapshotter:
    """Takes a snapshot after every ``every``-th committed step (0: never) of the sessions whose
    engine can export them."""

    def __init__(self, scripts: Scripts, engine: Engine, every: int) -> None:
        self.scripts = scripts
        self.engine = engine
        self.every = every
        self.written = 0

    def due(self, job: InboxEntry) -> bool:
        return self.every > 0 and job.mode is not Mode.TOKENS and (job.step_id + 1) % self.every == 0

    async def after_commit(self, job: InboxEntry, output_digest: bytes, worker_id: str) -> bool:
        """Snapshot the session after its committed step ``job``; the commit stands either way, so a
        failure here only costs a longer replay on failover (warned, never raised)."""
        state = self.engine.export_session(job.session_id)  # now: before the session's next step
        if state is None:
            return False
        try:
            blob = (await asyncio.to_thread(pack, job.step_id, job.gen, state, output_digest)
                    if len(state) > _THREAD_BYTES else pack(job.step_id, job.gen, state, output_digest))
            written = await self.scripts.save_snapshot(job.session_id, worker_id=worker_id, epoch=job.epoch,
                                                       step_id=job.step_id, gen=job.gen, snapshot=blob)
        except Exception as exc:  # Redis unreachable, a script error: the next snapshot tries again
            log.warning("snapshot of %s after step %d not saved: %s", job.session_id, job.step_id, exc)
            return False
        self.written += int(written)
        return written


# ------------------------------------------------------------------ step records and rebuilds

def step_record(payload: bytes, output: Mapping[str, Any], *, version: int, context_length: int,
                mode: Mode) -> bytes:
    record: dict[str, Any] = {"payload": payload, "digest": output_digest(output), "digest_kind": DIGEST_KIND,
                              "version": version, "context_length": context_length}
    if mode is Mode.TOKENS:
        record["generated"] = [int(t) for t in output.get("token_ids", ())]
        # A step continued across a weight update (partial rollout) records the version of its
        # last tokens; its first ones came from older weights, so a replay cannot reproduce it.
        if (first := first_version(output, version)) != version:
            record["first_version"] = first
    return encode(record)


def teacher_forced(step: StepInput, record: Mapping[str, Any]) -> TokenStep:
    """A recorded token step with its generated ids appended and nothing to generate."""
    assert isinstance(step, TokenStep)
    return replace(step, token_ids=(*step.token_ids, *record["generated"]),
                   sampling=replace(step.sampling, max_tokens=0), return_routed_experts=False)


def records_kept(mode: Mode, retention: str) -> int:
    """How many step records a session keeps: -1 all, N the last N, 0 none.

    Token sessions always keep theirs (token ids are small, and they are the context);
    world-model sessions follow their retention policy (inputs carry images).
    """
    if mode is Mode.TOKENS or retention == "full":
        return -1
    if retention == "none":
        return 0
    if retention.startswith("last:"):
        return max(0, int(retention.split(":", 1)[1]))
    return -1


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild cost: its time, the engine requests it made and the steps they replayed."""

    ms: float
    engine_calls: int
    replayed_steps: int  # steps run through the engine one by one (0 for a one-prefill rebuild)
    snapshot_step: int | None = None  # the step of the restored snapshot, if one was


async def rebuild_context(redis: Redis, keys: CellKeys, batcher: Batcher, engine: Engine, *, session_id: str,
                          model: str, mode: Mode, committed: int, version: int, gen: int) -> Rebuilt:
    """Rebuild the context of steps 0..committed in an engine running policy ``version``: a token
    session in one prefill of its recorded tokens; a session with a usable snapshot from it and
    the steps after it; else by replaying every step. Raises ContextLost."""
    started = time.perf_counter()
    snapshot = None
    if mode is not Mode.TOKENS:
        snapshot = await _restore(redis, keys, engine, session_id=session_id, model=model, committed=committed,
                                  gen=gen)
    first = 0 if snapshot is None else snapshot.step + 1
    records = await _records(redis, keys, session_id, first, committed)
    prefill = one_prefill(session_id, model, records) if mode is Mode.TOKENS else None
    if prefill is not None:
        await _run(batcher, prefill, committed, records[-1], by_length=True)
        calls, replayed = 1, 0
    else:
        calls = replayed = await _replay(batcher, session_id, model, mode, records, first, version)
    elapsed = (time.perf_counter() - started) * 1000.0
    log.info("rebuilt %s (%d steps) in %.1f ms with %d engine requests%s", session_id, committed + 1, elapsed,
             calls, "" if snapshot is None else f" after the snapshot of step {snapshot.step}")
    return Rebuilt(ms=elapsed, engine_calls=calls, replayed_steps=replayed,
                   snapshot_step=None if snapshot is None else snapshot.step)


async def _restore(redis: Redis, keys: CellKeys, engine: Engine, *, session_id: str, model: str, committed: int,
                   gen: int) -> Snapshot | None:
    """Import the session's snapshot into the engine; None (warned when there was one) if unusable."""
    snapshot = await load_snapshot(redis, keys, session_id, gen=gen, committed=committed)
    if snapshot is None:
        return None
    raw: Any = await resolve(redis.hget(keys.log(session_id), log_input_field(snapshot.step)))
    if raw is not None and _digest_of(raw) != snapshot.output:  # kept while the retention keeps it
        log.warning("the snapshot of %s does not match its step %d; replaying every step", session_id, snapshot.step)
        return None
    if not engine.import_session(session_id, model, snapshot.state):
        log.warning("the engine refused the snapshot of %s; replaying every step", session_id)
        return None
    return snapshot


def _digest_of(raw: bytes) -> bytes | None:
    """A step record's output digest; None when the record does not read as one."""
    try:
        digest = decode(raw)["digest"]
    except (FleetError, KeyError, TypeError):
        return None
    return digest if isinstance(digest, bytes) else None


async def _records(redis: Redis, keys: CellKeys, session_id: str, first: int, committed: int) -> list[dict[str, Any]]:
    """The step records first..committed; ContextLost when the retention dropped some."""
    fields = [log_input_field(i) for i in range(first, committed + 1)]
    raw: list[bytes | None] = await resolve(redis.hmget(keys.log(session_id), fields)) if fields else []
    missing = [first + i for i, rec in enumerate(raw) if rec is None]
    if missing:
        raise ContextLost(f"the session's retention kept no inputs for steps {missing[0]}..{missing[-1]} and no "
                          "snapshot covers them; its context cannot be rebuilt on a new worker (reset the session)")
    records = [decode(rec) for rec in raw if rec is not None]
    try:  # large inputs are kept beside their records (broker/redis/inputs.py)
        await read_record_inputs(redis, keys, session_id, list(enumerate(records, start=first)))
    except InputGone as exc:
        raise ContextLost(f"{exc}; the context cannot be rebuilt on a new worker (reset the session)") from exc
    return records


def one_prefill(session_id: str, model: str, records: list[dict[str, Any]]) -> EngineRequest | None:
    """A token session's whole context as one request: every step's input ids and generated ids,
    in order, generating nothing. None where that cannot stand for the steps (multimodal inputs,
    records without generated ids): those replay step by step."""
    ids: list[int] = []
    for record in records:
        step = parse_step_input(Mode.TOKENS, decode(record["payload"]))
        if not isinstance(step, TokenStep) or step.multimodal or "generated" not in record:
            return None
        ids += [*step.token_ids, *record["generated"]]
    if not records:
        return None
    step = TokenStep(token_ids=tuple(ids), sampling=SamplingParams(max_tokens=0))
    return EngineRequest(session_key=session_id, model=model, step=step, reset=True)


async def _replay(batcher: Batcher, session_id: str, model: str, mode: Mode, records: list[dict[str, Any]],
                  first: int, version: int) -> int:
    """Run the steps first.. in order (onto a restored snapshot when first > 0); how many ran."""
    # Records written before versions were recorded count as this version (digests still check).
    other = next(((first + i, r.get("first_version", r.get("version", version))) for i, r in enumerate(records)
                  if {r.get("version", version), r.get("first_version", version)} != {version}), None)
    if other is not None and (mode is not Mode.TOKENS or any("generated" not in r for r in records)):
        what = ("a world-model context" if mode is not Mode.TOKENS
                else "this token session's records predate generated-token records, so its context")
        raise ContextLost(f"step {other[0]} was produced by policy version {other[1]} and this worker runs "
                          f"version {version}: {what} cannot be rebuilt across weight versions "
                          "(reset the session)")
    for offset, record in enumerate(records):
        step = parse_step_input(mode, decode(record["payload"]))
        if other is not None:
            step = teacher_forced(step, record)
        request = EngineRequest(session_key=session_id, model=model, step=step, reset=first + offset == 0)
        await _run(batcher, request, first + offset, record, by_length=other is not None)
    return len(records)


async def _run(batcher: Batcher, request: EngineRequest, index: int, record: Mapping[str, Any], *,
               by_length: bool) -> None:
    """One rebuild request, checked against the record of step ``index``: by the context length it
    leaves (teacher-forced tokens) or by the digest of its output (a replay)."""
    try:
        out = await batcher.run(request)
    except StepAborted as exc:  # a weight update stopped the replay: the caller starts it over
        # Plain StepAborted: tokens a replayed step had generated are no part of the step that
        # runs after the rebuild, so no partial output may reach its continuation.
        raise StepAborted(f"the context rebuild was aborted: {exc.message}") from None
    except Exception as exc:
        raise ContextLost(f"replaying step {index} failed: {exc}") from exc
    if by_length:
        if out.context_length != record["context_length"]:
            raise ContextLost(f"the rebuilt context of step {index} holds {out.context_length} tokens; "
                              f"the committed step left {record['context_length']}")
    elif output_digest(out.output, record_digest_kind(record)) != record["digest"]:
        raise ContextLost(f"replayed step {index} differs from its committed output; "
                          "the engine is not deterministic for this session")
