"""Context rebuild: a new owner replays a session's committed step records through its engine.

Each committed step leaves a record: its input payload, a digest of its output, the policy version
that produced it, the context length after it and, for token steps, the generated token ids.

- Every record produced by the weights this engine runs now: replaying the records in order
  rebuilds the context exactly; every replayed output must match its digest, so a wrong context is
  caught before it produces a wrong commit.
- Some record produced by other weights (a weight update happened since, or a partial rollout's
  step continued across one: ``first_version``): a replay cannot give the same outputs. A token
  session's context is its token ids, all recorded: each step is fed with its generated ids
  appended and nothing generated (``max_tokens=0``), checked by context length. A world-model
  context is the model's own state under the old weights and cannot be rebuilt: the rebuild fails
  with CONTEXT_LOST and says why (reset the session).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.keys import CellKeys
from broker.redis.layouts import log_input_field
from schemas.codec import decode, encode
from schemas.errors import ContextLost, StepAborted
from schemas.messages import Mode, StepInput, TokenStep, parse_step_input
from workers.batcher import Batcher
from workers.continuation import VERSIONS_KEY, first_version
from workers.engines.base import EngineRequest

log = logging.getLogger(__name__)


def output_digest(output: Mapping[str, Any]) -> bytes:
    """A fingerprint of a step's output for replay checks (not a security boundary): arrays are
    hashed in place, so a latent is read once and never re-encoded. ``weight_versions`` is left
    out: the worker adds it to the engine's output, and a replay compares the engine's alone."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(output):
        if key == VERSIONS_KEY:
            continue
        value = output[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        else:
            h.update(encode(value))
    return h.digest()


def step_record(payload: bytes, output: Mapping[str, Any], *, version: int, context_length: int,
                mode: Mode) -> bytes:
    record: dict[str, Any] = {"payload": payload, "digest": output_digest(output), "version": version,
                              "context_length": context_length}
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


async def rebuild_context(redis: Redis, keys: CellKeys, batcher: Batcher, *, session_id: str, model: str,
                          mode: Mode, committed: int, version: int) -> float:
    """Replay steps 0..committed into an engine running policy ``version``; returns the ms it took.
    Raises ContextLost."""
    started = time.perf_counter()
    fields = [log_input_field(i) for i in range(committed + 1)]
    raw: list[bytes | None] = await resolve(redis.hmget(keys.log(session_id), fields))
    missing = [i for i, rec in enumerate(raw) if rec is None]
    if missing:
        raise ContextLost(f"the session's retention kept no inputs for steps {missing[0]}..{missing[-1]}; "
                          "its context cannot be rebuilt on a new worker (reset the session)")
    records = [decode(rec) for rec in raw if rec is not None]
    # Records written before versions were recorded count as this version (digests still check).
    other = next(((i, r.get("first_version", r.get("version", version))) for i, r in enumerate(records)
                  if {r.get("version", version), r.get("first_version", version)} != {version}), None)
    if other is not None and (mode is not Mode.TOKENS or any("generated" not in r for r in records)):
        what = ("a world-model context" if mode is not Mode.TOKENS
                else "this token session's records predate generated-token records, so its context")
        raise ContextLost(f"step {other[0]} was produced by policy version {other[1]} and this worker runs "
                          f"version {version}: {what} cannot be rebuilt across weight versions "
                          "(reset the session)")
    for index, record in enumerate(records):
        step = parse_step_input(mode, decode(record["payload"]))
        if other is not None:
            step = teacher_forced(step, record)
        request = EngineRequest(session_key=session_id, model=model, step=step, reset=index == 0)
        try:
            out = await batcher.run(request)
        except StepAborted as exc:  # a weight update stopped the replay: the caller starts it over
            # Plain StepAborted: tokens a replayed step had generated are no part of the step that
            # runs after the rebuild, so no partial output may reach its continuation.
            raise StepAborted(f"the context rebuild was aborted: {exc.message}") from None
        except Exception as exc:
            raise ContextLost(f"replaying step {index} failed: {exc}") from exc
        if other is not None:
            if out.context_length != record["context_length"]:
                raise ContextLost(f"replayed step {index} left {out.context_length} tokens of context; "
                                  f"the committed step left {record['context_length']}")
        elif output_digest(out.output) != record["digest"]:
            raise ContextLost(f"replayed step {index} differs from its committed output; "
                              "the engine is not deterministic for this session")
    elapsed = (time.perf_counter() - started) * 1000.0
    log.info("rebuilt %s from %d steps in %.1f ms", session_id, committed + 1, elapsed)
    return elapsed
