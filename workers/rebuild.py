"""Context rebuild: a new owner rebuilds a session's engine context from its committed step records.

Each committed step leaves a record: its input payload, a digest of its output, the policy version
that produced it, the context length after it and, for token steps, the generated token ids. A
payload that was staged (broker/redis/inputs.py) is the mark in the record and its bytes are in the
step's record blob, read back in one round trip with the records.

- A token session's context is its token ids, all recorded: one request of every step's input ids
  and generated ids, in order, generating nothing (``max_tokens=0``), rebuilds it in one prefill,
  checked by context length; whatever weights produced the steps. Steps with multimodal inputs
  are replayed one by one instead (their features are not token ids).
- A session whose engine exported snapshots (workers/snapshots.py) restores the latest usable one
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

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.inputs import InputGone, read_record_inputs
from broker.redis.keys import CellKeys
from broker.redis.layouts import log_input_field
from schemas.codec import decode, encode
from schemas.errors import ContextLost, FleetError, StepAborted
from schemas.messages import Mode, SamplingParams, StepInput, TokenStep, parse_step_input
from workers.batcher import Batcher
from workers.continuation import first_version
from workers.digests import DIGEST_KIND, output_digest, record_digest_kind
from workers.engines.base import Engine, EngineRequest
from workers.snapshots import Snapshot, load_snapshot

log = logging.getLogger(__name__)


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
