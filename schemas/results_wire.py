"""Direct results: the wire between a worker that keeps a large committed result and the trainer
that fetches it from there, one hop instead of two through Redis.

A large result (``STAGE_BYTES`` or more, broker/redis/blobs.py) is still staged in Redis and
committed there: Redis keeps the commit, the step's stored result and the reply entry, so a re-sent
step is answered from Redis after the worker died and every guarantee of the two-hop path holds.
What one hop takes off the master is the second copy: the trainer's ``GET`` of 450 KB, which Redis
copies into a reply buffer and writes to a socket on its one main thread (docs/sizing.md). A worker
started with ``--serve-results`` (workers/result_server.py) keeps each large result it committed
for a few seconds and advertises where (its worker hash's ``results_at``); a trainer whose reply
refers to an in-place result blob asks that worker for the job's bytes first
(broker/client/direct.py) and reads Redis as before when the worker does not answer, answers "not
held", or is not the one that committed.

The protocol, over one TCP connection that carries any number of requests in turn:

- request: ``MAGIC``, a big-endian uint16 length, the job id (UTF-8);
- response: ``MAGIC``, one status byte (``HELD``: the bytes follow; ``NOT_HELD``: nothing), a
  big-endian uint64 length, then that many bytes.

No pickle, nothing but bytes: what a worker answers is the job's encoded result exactly as it was
staged in Redis (a ``schemas.codec`` frame), which the trainer decodes like the one it reads from
Redis. A worker answers only for a job whose commit it saw succeed, so the bytes are the committed
ones; a job id is 128 random bits, the only name a result is fetched by.
"""

from __future__ import annotations

import asyncio
import struct

MAGIC = b"RF1"  # protocol and version: a peer that answers anything else is not a result server
HELD = 1
NOT_HELD = 0
MAX_JOB_ID_BYTES = 256
MAX_RESULT_BYTES = 1 << 32  # a larger length is a broken peer, not a result
WILDCARD_HOSTS = ("0.0.0.0", "::")  # listen on every address: never one to advertise
_REQUEST = struct.Struct(">H")
_RESPONSE = struct.Struct(">BQ")


class ProtocolError(Exception):
    """The peer broke the protocol (a wrong magic, an impossible length): drop the connection."""


def request(job_id: str) -> bytes:
    """One request for the result of ``job_id``."""
    raw = job_id.encode("utf-8")
    if not 0 < len(raw) <= MAX_JOB_ID_BYTES:
        raise ValueError(f"a job id is 1 to {MAX_JOB_ID_BYTES} bytes, got {len(raw)}")
    return MAGIC + _REQUEST.pack(len(raw)) + raw


async def read_request(reader: asyncio.StreamReader) -> str:
    """The job id of the next request; raises ``asyncio.IncompleteReadError`` at the end of the
    stream and :class:`ProtocolError` on anything that is not a request."""
    head = await reader.readexactly(len(MAGIC) + _REQUEST.size)
    if head[:len(MAGIC)] != MAGIC:
        raise ProtocolError("not a result request")
    (size,) = _REQUEST.unpack_from(head, len(MAGIC))
    if not 0 < size <= MAX_JOB_ID_BYTES:
        raise ProtocolError(f"a job id of {size} bytes")
    try:
        return (await reader.readexactly(size)).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("a job id that is not UTF-8") from exc


def response_head(data: bytes | None) -> bytes:
    """The header of the answer: ``data`` follows it when held."""
    if data is None:
        return MAGIC + _RESPONSE.pack(NOT_HELD, 0)
    return MAGIC + _RESPONSE.pack(HELD, len(data))


async def read_response(reader: asyncio.StreamReader) -> bytes | None:
    """The bytes of one answer, None when the worker does not hold the result."""
    head = await reader.readexactly(len(MAGIC) + _RESPONSE.size)
    if head[:len(MAGIC)] != MAGIC:
        raise ProtocolError("not a result response")
    status, size = _RESPONSE.unpack_from(head, len(MAGIC))
    if status == NOT_HELD and size == 0:
        return None
    if status != HELD or size > MAX_RESULT_BYTES:
        raise ProtocolError(f"status {status} with {size} bytes")
    return await reader.readexactly(size)


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) as (host, port); ValueError when it is not one."""
    host, port = _split_address(text)
    if port is None:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, port


def parse_host_or_address(text: str) -> tuple[str, int | None]:
    """``host:port`` as (host, port), or a ``host`` alone as (host, None): what a worker advertises
    when the port is the one it got (``--serve-results HOST:0``). An IPv6 host is in brackets
    (``[fd00::5]``, ``[fd00::5]:7070``), so that its last group is never read as a port."""
    host, port = _split_address(text)
    if port is None and host.isdigit():
        raise ValueError(f"{text!r} is a port alone: give HOST or HOST:PORT")
    return host, port


def _split_address(text: str) -> tuple[str, int | None]:
    """(host, port), or (host, None) for a host alone; ValueError for what is neither."""
    if text.startswith("[") and text.endswith("]"):
        host, port_text = text[1:-1], None
    elif ":" not in text:
        host, port_text = text, None
    else:
        host, _, port_text = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise ValueError(f"an IPv6 host goes in brackets ([HOST]:PORT), got {text!r}")
        if not port_text.isdigit():
            raise ValueError(f"expected HOST:PORT, got {text!r}")
    if not host or any(c.isspace() or c in "[]/" for c in host):
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if port_text is None:
        return host, None
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not 0..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
