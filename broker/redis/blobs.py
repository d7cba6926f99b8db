"""Large step results outside Lua arguments: staged with a plain SET, moved by commit.lua, read by one GET.

Redis copies every script argument into a Lua string on its single thread: ~620 us for a 450 KB
latent result and 2.6 ms for 1.8 MB, against ~4 us for the same bytes as a SET argument
(docs/benchmarks.md, "Result bytes out of Lua arguments"), which capped a cell well under 1,000
latent steps/s whatever its number of workers. So a result of ``STAGE_BYTES`` or more leaves the
worker as ``SET <staged key> <bytes> PX STAGE_TTL_MS`` pipelined right before the commit call on
the same connection (the same slot: every key carries the cell's hash tag). commit.lua moves it
with RENAME / COPY, commands that never bring the bytes into Lua: into the step's result blob
(``CellKeys.result_blob``, kept like the log hash field it stands for) and, for the reply, into a
reply blob (``CellKeys.reply_blob``, with the reply stream's TTL). The step's log field
(``result@<slot>``) and the reply entry's ``result`` then hold a reference: ``BLOB_MARK`` followed
by the key name. 0xc1 is the one byte msgpack never uses, and a ``schemas.codec`` frame (which
starts with it) has a version byte after it that is never 0: a reference can never be mistaken for
a result.

Readers resolve a reference with one GET; a blob that is gone (its TTL passed, its session was
reset) reads as ``None``, which each reader answers like a result that was not stored.

**In place.** A reply stream whose reader reads large results where the log keeps them (the
trainer's ``ReplyReader``, broker/client/replies.py, keeps ``CellKeys.in_place_reader`` standing
while it runs, ``IN_PLACE_READER_TTL_MS`` at a time) gets no reply blob: a commit that finds that
key publishes a ``result`` of ``IN_PLACE_MARK``, the result blob's key, a NUL and the reply blob
the reader would own, and the blob's marker (``CellKeys.in_place_marker``, a HASH) holds that reply blob as
a field while the reply is unread. That saves the master a copy of every large result (a ``COPY``
of 450 KB was 5-12% of a latent step's main thread: docs/sizing.md). The reader reads with ``GET``
of the result blob, ``GETDEL`` of the reply blob and ``HDEL`` of its field in one round trip
(``read_reply_blobs``); a result blob that leaves the log (its window moved on, a reset, a close)
while its marker holds a reader goes to that reader: RENAMEd to its reply blob (prelude.lua
``hand_over_or``), which the same read then finds and prefers (after a reset the log's blob of the
same step may hold a later trajectory's result). A stream without the key (a consumer group's, an
earlier release's trainer's) gets a copy as before; so does a re-publish of a stored result. The
check costs a commit one ``EXISTS``, and only for a staged result: a token step pays nothing for it.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from broker.redis.aio import resolve
from broker.redis.keys import CellKeys
from broker.redis.script_replies import EnqueueReply, Refused, Stored
from schemas.errors import ErrorCode, FleetError, error_for

# From the transport bench (python -m bench.transport --size full): below ~32 KiB the Lua copy
# costs less than the extra SET command it would save; from there on it grows by ~1.4 us per KiB.
log = logging.getLogger(__name__)
STAGE_BYTES = 32 * 1024
# How long a staged result waits for its commit: the commit is the next command on the same
# connection, so this only bounds what a worker that died between the two leaves behind.
STAGE_TTL_MS = 60_000
BLOB_MARK = b"\xc1\x00"
IN_PLACE_MARK = BLOB_MARK + b"\x00"  # a key name never starts with a NUL byte
# How long a reader's CellKeys.in_place_reader key stands unless renewed; ReplyReader renews it every third
# of that. A reader that died leaves it this long (commits keep replying in place, which only its
# own read can use); an earlier release's reader must not take over the same client id before.
IN_PLACE_READER_TTL_MS = 600_000


def in_place_keys(value: bytes | None) -> tuple[str, str] | None:
    """(the log's result blob, the reply blob its reader owns once it is handed over) of an in-place
    reference, or None when ``value`` is not one."""
    if value is None or not value.startswith(IN_PLACE_MARK):
        return None
    blob, sep, reply_blob = value[len(IN_PLACE_MARK):].partition(b"\x00")
    if not sep:
        return None
    return blob.decode("utf-8", "replace"), reply_blob.decode("utf-8", "replace")


def blob_key(value: bytes | None) -> str | None:
    """The key a stored result refers to (for an in-place reference, the log's result blob), or
    None when ``value`` is the result itself."""
    if value is None or not value.startswith(BLOB_MARK):
        return None
    keys = in_place_keys(value)
    if keys is not None:
        return keys[0]
    return value[len(BLOB_MARK):].decode("utf-8", "replace")


def stage_command(key: str, result: bytes) -> list[Any]:
    """The SET that stages ``result`` under ``key`` before its commit."""
    return ["SET", key, result, "PX", STAGE_TTL_MS]


async def resolved(redis: Redis, value: bytes, *, delete: bool = False) -> bytes | None:
    """``value`` itself, or the bytes of the blob it refers to (None: the blob is gone).
    ``delete``: read it with GETDEL (a reader that is the blob's only reader)."""
    key = blob_key(value)
    if key is None:
        return value
    data: Any = await (redis.getdel(key) if delete else redis.get(key))
    return None if data is None else bytes(data)


async def read_blobs(redis: Redis, keys: list[str], *, delete: bool = False) -> list[Any]:
    """The bytes of each blob in ``keys`` (None: gone) in one round trip: a pipeline, or the plain
    command for one key (a pipeline of one costs more). An error of one key comes back in its place.
    ``delete``: GETDEL, for a reader that is each blob's only reader."""
    if len(keys) == 1:
        try:
            return [await (redis.getdel(keys[0]) if delete else redis.get(keys[0]))]
        except ResponseError as exc:  # in its place, as the pipeline answers it
            return [exc]
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            if delete:
                pipe.getdel(key)
            else:
                pipe.get(key)
        values: list[Any] = await pipe.execute(raise_on_error=False)
    return values


async def read_reply_blobs(redis: Redis, refs: list[bytes]) -> list[Any]:
    """The bytes of each reference in ``refs`` (None: gone), read by the reply's one reader in one
    round trip: a reply blob with ``GETDEL``; an in-place one with ``GET`` of the log's result blob,
    ``GETDEL`` of the reply blob it may have been handed over to (which wins: after a reset the log's
    blob of the same step may hold a later trajectory's result) and ``HDEL`` of this reply's field of
    the marker (the reply is read: the log deletes the blob when its window moves on). An error of
    one reference comes back in its place."""
    places = [in_place_keys(ref) for ref in refs]
    if len(refs) == 1 and places[0] is None:
        return await read_blobs(redis, [blob_key(refs[0]) or ""], delete=True)
    async with redis.pipeline(transaction=False) as pipe:
        for ref, place in zip(refs, places, strict=True):
            if place is None:
                pipe.getdel(blob_key(ref) or "")
            else:
                blob, reply_blob = place
                pipe.get(blob)
                pipe.getdel(reply_blob)
                pipe.hdel(CellKeys.in_place_marker(blob), reply_blob)
        values: list[Any] = await pipe.execute(raise_on_error=False)
    out: list[Any] = []
    at = 0
    for place in places:
        if place is None:
            out.append(values[at])
            at += 1
            continue
        kept, handed = values[at], values[at + 1]
        at += 3
        # Handed over wins: after a reset the log's blob of the same step may hold a later result.
        if handed is not None and not isinstance(handed, Exception):
            out.append(handed)
        else:
            out.append(kept if kept is not None else handed)
    return out


async def mark_read(redis: Redis, refs: list[bytes]) -> None:
    """Mark in-place replies read whose bytes came another way (from the worker that committed
    them: broker/client/direct.py): ``DEL`` of the reply blob each may have been handed over to and
    ``HDEL`` of its marker field, in one round trip, no bytes. One that fails is left to the TTLs
    (the marker's, the handed-over blob's): logged, never raised."""
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for ref in refs:
                place = in_place_keys(ref)
                if place is None:
                    continue
                blob, reply_blob = place
                pipe.delete(reply_blob)
                pipe.hdel(CellKeys.in_place_marker(blob), reply_blob)
            await pipe.execute(raise_on_error=False)
    except Exception as exc:
        log.info("%d in-place replies not marked read (their TTLs will): %s", len(refs), exc)


def gone_message(what: str, key: str) -> str:
    """Why a reference's result cannot be read: the step stays committed, its bytes are gone."""
    return (f"{what} was committed but its result (stored outside the log, {key}) is gone: it expired or its "
            "session was reset or closed before it was read")


def blob_gone(what: str, key: str) -> FleetError:
    """The error of a reference whose blob is gone (step_already_committed)."""
    return error_for(ErrorCode.STEP_ALREADY_COMMITTED, gone_message(what, key))


async def after_command(redis: Redis, command: list[Any], script: AsyncScript, keys: list[str],
                        args: list[Any]) -> Any:
    """``command`` and then ``script`` in one pipeline: one connection, in this order (on a cluster,
    the node of their one slot). The script is loaded when the server answers NOSCRIPT."""
    for _ in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.execute_command(*command)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            _, reply = await pipe.execute(raise_on_error=False)
        if not isinstance(reply, NoScriptError):
            break
        await redis.script_load(script.script)
    if isinstance(reply, Exception):
        raise reply
    return reply


def unless_unstaged(raw: Any) -> Any:
    """commit.lua's reply, unless it is an error (raised) or says the staged result was missing (its
    SET failed or was lost; nothing changed): that raises as a lost connection would, and the
    caller's retry stages the result again."""
    if isinstance(raw, Exception):
        raise raw
    if isinstance(raw, list) and raw and raw[0] in (b"unstaged", "unstaged"):
        raise RedisConnectionError("the staged result was not there when the commit ran; commit again")
    return raw


async def stored_resolved(redis: Redis, reply: EnqueueReply, *, session_key: str, step_id: int) -> EnqueueReply:
    """enqueue.lua's reply with a stored result's blob read; a blob that is gone answers as a result
    that was not stored does (step_already_committed)."""
    if not isinstance(reply, Stored) or blob_key(reply.result) is None:
        return reply
    data = await resolved(redis, reply.result)
    if data is not None:
        return Stored(data, reply.committed_step_id)
    context: Any = await resolve(redis.hget(session_key, "context_length"))
    message = gone_message(f"step {step_id}", blob_key(reply.result) or "")
    return Refused(ErrorCode.STEP_ALREADY_COMMITTED, message, reply.committed_step_id, int(context or 0))
