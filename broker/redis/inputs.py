"""Large step payloads outside Lua arguments: staged with a plain SET, moved by the scripts, read by one GET.

An observation with images costs Redis what a large result does (broker/redis/blobs.py): every
script argument is copied into a Lua string on Redis's single thread, ~1.4 us per KiB. So a payload
of ``STAGE_BYTES`` or more leaves the trainer as ``SET <staged key> <bytes> PX STAGE_TTL_MS``
pipelined right before the enqueue call on the same connection (the same slot: every key carries
the cell's hash tag), and enqueue.lua RENAMEs it to the job's input blob (``CellKeys.input_blob``).
The inbox entry's payload is then ``STAGED`` alone: the blob's name follows from the entry's
session and job ids, so an entry never names a key a worker would touch.

The blob lives exactly as long as its entry: failover.lua moves the entry and the blob stays
where it is; commit.lua RENAMEs it to the step's record blob (``CellKeys.record_blob``) when the
step record is kept (the record's payload is then ``STAGED`` too, and the record blob goes with
the record: retention, reset, close, fork) and deletes it otherwise; report.lua deletes it with the
entry; retire.lua reads it into the orphan's dead letter within the dead-letter budget; a worker
rejecting a malformed entry deletes it with the entry. A fenced worker deletes nothing (the entry
went on with its session). A payload that starts with
``BLOB_MARK`` is always staged, so an inline payload is never taken for the marker.
"""

from __future__ import annotations

import os
from typing import Any

from redis.asyncio import Redis

from broker.redis.aio import resolve
from broker.redis.blobs import BLOB_MARK, STAGE_BYTES, stage_command
from broker.redis.keys import CellKeys
from broker.redis.layouts import DEAD_LETTER_PAYLOAD_BYTES, too_large_to_keep

STAGED = BLOB_MARK


def stages(payload: bytes, stage_bytes: int = STAGE_BYTES) -> bool:
    """Whether ``payload`` travels staged: large, or starting like the marker."""
    return len(payload) >= stage_bytes or payload.startswith(BLOB_MARK)


def is_staged(payload: bytes) -> bool:
    """An inbox entry's or a step record's payload that says "in the blob"."""
    return payload == STAGED


def enqueue_staging(keys: CellKeys, session_id: str, job_id: str, payload: bytes) -> tuple[list[str], list[Any]]:
    """enqueue.lua's two extra keys for a staged payload and the SET that stages it. The staged
    key is new per call: a retry whose first call went through never overwrites a queued input."""
    staged = keys.staged_input(session_id, os.urandom(8).hex())
    return [staged, keys.input_blob(session_id, job_id)], stage_command(staged, payload)


class InputGone(Exception):
    """A staged input that is no longer in Redis (only a Redis that lost writes gets here)."""


async def read_input(redis: Redis, keys: CellKeys, session_id: str, job_id: str) -> bytes:
    """The bytes of a queued job's staged payload; raises InputGone."""
    data: Any = await resolve(redis.get(keys.input_blob(session_id, job_id)))
    if data is None:
        raise InputGone(f"the step's payload (staged in {keys.input_blob(session_id, job_id)}) is gone: Redis "
                        "lost it (a failover before a replica had it, or a restart without persistence)")
    return bytes(data)


async def read_record_inputs(redis: Redis, keys: CellKeys, session_id: str,
                             records: list[tuple[int, dict[str, Any]]]) -> None:
    """Put the staged inputs of step records (step, record) back in their ``payload``, in one
    round trip; raises InputGone naming the first step whose input blob is gone."""
    staged = [(step, record) for step, record in records if is_staged(record.get("payload", b""))]
    if not staged:
        return
    data: list[Any] = await resolve(redis.mget([keys.record_blob(session_id, step) for step, _ in staged]))
    for (step, record), value in zip(staged, data, strict=True):
        if value is None:
            raise InputGone(f"the input of step {step} (kept in {keys.record_blob(session_id, step)}) is gone")
        record["payload"] = bytes(value)


async def dead_letter_input(redis: Redis, keys: CellKeys, session_id: str, job_id: str) -> tuple[bytes, str]:
    """What a dead letter keeps of a staged payload, as ``dead_letter_payload`` answers: the bytes
    within the budget, else nothing and why. Reads at most the budget and one byte."""
    key = keys.input_blob(session_id, job_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.strlen(key)
        pipe.getrange(key, 0, DEAD_LETTER_PAYLOAD_BYTES)
        size, head = await pipe.execute()
    if not size:
        return b"", "its staged payload was gone"
    if size > DEAD_LETTER_PAYLOAD_BYTES:
        return b"", too_large_to_keep(size)
    return bytes(head), ""
