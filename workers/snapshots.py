"""Snapshots of engine contexts: a session's context, saved every N committed steps, lets a new owner
restore it and replay at most N steps instead of every step of the session.

Only engines that can export a session's context take part (``Engine.export_session``; the
reference world model can); token sessions need none (their context is rebuilt from the recorded
tokens in one prefill, workers/rebuild.py). A snapshot lives in the session's log hash
(``LOG_SNAPSHOT_FIELD``, written by snapshot.lua only after the step's commit) as a msgpack map:

- ``step``: the committed step it follows; ``gen``: the session's gen when it was taken;
- ``state``: the engine's export, zlib-compressed; ``digest``: blake2b of ``state`` as stored;
- ``output``: the digest of that step's output, checked against its step record when one is kept.

Restoring checks all of these; a snapshot that fails a check is ignored with a warning, and the
context is rebuilt by a full replay as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.inbox import InboxEntry
from broker.redis.keys import CellKeys
from broker.redis.layouts import LOG_SNAPSHOT_FIELD
from broker.redis.scripts import Scripts
from schemas.codec import decode, encode
from schemas.errors import FleetError
from schemas.messages import Mode
from workers.engines.base import Engine

log = logging.getLogger(__name__)
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
