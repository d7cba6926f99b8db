"""Context rebuild: a new owner replays a session's committed step records through its engine.

Each committed step leaves a record (its input payload and a digest of its output). Replaying the
records in order rebuilds the engine's context; where the engine is deterministic every replayed
output must match its digest, so a wrong context is caught before it produces a wrong commit.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from redis.asyncio import Redis

from broker.aio import resolve
from broker.keys import CellKeys
from schemas.codec import decode, encode
from schemas.errors import ErrorCode, FleetError
from schemas.messages import Mode, parse_step_input
from workers.batcher import Batcher
from workers.engines.base import EngineRequest, StepAborted

log = logging.getLogger(__name__)


class ContextLost(FleetError):
    code = ErrorCode.CONTEXT_LOST


def output_digest(output: Mapping[str, Any]) -> bytes:
    """A fingerprint of a step's output for replay checks (not a security boundary): arrays are
    hashed in place, so a latent is read once and never re-encoded."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(output):
        value = output[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        else:
            h.update(encode(value))
    return h.digest()


def step_record(payload: bytes, output: Mapping[str, Any]) -> bytes:
    return encode({"payload": payload, "digest": output_digest(output)})


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
                          mode: Mode, committed: int) -> float:
    """Replay steps 0..committed into the engine; returns the ms it took. Raises ContextLost."""
    started = time.perf_counter()
    fields = [f"input:{i}" for i in range(committed + 1)]
    raw: list[bytes | None] = await resolve(redis.hmget(keys.log(session_id), fields))
    missing = [i for i, rec in enumerate(raw) if rec is None]
    if missing:
        raise ContextLost(f"the session's retention kept no inputs for steps {missing[0]}..{missing[-1]}; "
                          "its context cannot be rebuilt on a new worker (reset the session)")
    for index, rec in enumerate(raw):
        assert rec is not None
        record = decode(rec)
        step = parse_step_input(mode, decode(record["payload"]))
        request = EngineRequest(session_key=session_id, model=model, step=step, reset=index == 0)
        try:
            out = await batcher.run(request)
        except StepAborted:  # a weight update stopped the replay: the caller starts it over
            raise
        except Exception as exc:
            raise ContextLost(f"replaying step {index} failed: {exc}") from exc
        if output_digest(out.output) != record["digest"]:
            raise ContextLost(f"replayed step {index} differs from its committed output; "
                              "the engine is not deterministic for this session")
    elapsed = (time.perf_counter() - started) * 1000.0
    log.info("rebuilt %s from %d steps in %.1f ms", session_id, committed + 1, elapsed)
    return elapsed
