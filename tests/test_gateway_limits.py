"""The gateway as a denial-of-service surface: a huge body is refused before it is read, an image's
declared size is checked before it is decoded (PNG header, .npy header), decoding runs off the
event loop, and a step the fleet never answers comes back as 504 within the step timeout."""

from __future__ import annotations

import asyncio
import base64
import select
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from broker.gateway import guards
from broker.gateway.settings import GatewaySettings
from broker.redis.embedded import RedisServer
from schemas.limits import Limits
from tests.support import WorkerPool
from tests.test_gateway import SESSIONS, GatewayServer, body, create, step_error
from tests.test_multiturn import reference_engine
from workers.engines.null import NullEngine, NullEngineConfig

MB = 1024 * 1024


@pytest.fixture
async def http(redis_server: RedisServer, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    async with GatewayServer(redis_server.url, prefix) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client:
        yield client


def blank_png(width: int, height: int) -> bytes:
    """A real, black RGB PNG built without encoding every pixel: one block of rows compressed with
    a full flush repeats byte for byte (9000x9000 is ~240 KB and takes seconds to decode)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = 40
    assert height % rows == 0
    block = (b"\x00" + bytes(3 * width)) * rows  # filter byte 0, then the row
    compressor = zlib.compressobj(9)
    head = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeat = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    adler = 1
    for _ in range(height // rows):
        adler = zlib.adler32(block, adler)
    data = head + repeat * (height // rows - 1) + b"\x03\x00" + struct.pack(">I", adler)  # empty last block
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def post_raw(port: int, path: str, total: int, *, declare: bool) -> tuple[int, bytes, int]:
    """POST a ``total``-byte body over a plain socket, one MB at a time, stopping as soon as the
    server answers or stops taking bytes. Returns (status, response bytes, body bytes sent).

    A plain socket because an HTTP client library gives up on the response when the server
    closes the connection in the middle of the body, which is exactly what the gateway must do."""
    framing = f"Content-Length: {total}" if declare else "Transfer-Encoding: chunked"
    piece = b" " * MB if declare else f"{MB:x}\r\n".encode() + b" " * MB + b"\r\n"
    sent, response = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     f"{framing}\r\n\r\n".encode())
        while sent < total and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(piece)
            except OSError:  # the server closed the connection: it stopped reading
                break
            sent += MB
        try:
            while chunk := sock.recv(65536):
                response += chunk
        except OSError:
            pass
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0
    return status, response, sent


async def test_a_200mb_body_is_refused_before_it_is_read(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    port, path = int(str(http.base_url).rstrip("/").rsplit(":", 1)[1]), f"{SESSIONS}/{sid}/step"
    status, response, sent = await asyncio.to_thread(post_raw, port, path, 200 * MB, declare=True)
    assert status == 413 and b"limit is 67108864" in response, response[:300]
    assert sent < 32 * MB  # refused from the header: the body was never taken in
    status, response, sent = await asyncio.to_thread(post_raw, port, path, 200 * MB, declare=False)
    assert status == 413 and b"limit is 67108864" in response, response[:300]
    assert sent < 64 * MB + 32 * MB  # counted while streaming: reading stopped at the limit, not at 200 MB
    assert (await http.get(f"{SESSIONS}/{sid}/status")).json()["committed_step_id"] == -1


async def test_a_client_still_sending_gets_the_whole_413(redis_server: RedisServer, prefix: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused mid-stream, the client keeps sending until it sees the answer. Were the socket closed
    with those bytes unread, the kernel's reset could drop the 413 on the way (up to a third of
    streamed tries on loopback, measured): every try, one after another, must read the whole JSON
    error. A loopback client stops within milliseconds, so a short quiet time keeps the test quick."""
    monkeypatch.setattr(guards, "LINGER_QUIET_S", 0.05)
    async with GatewayServer(redis_server.url, prefix, settings=GatewaySettings(max_body_bytes=MB)) as server:
        port = int(server.url.rstrip("/").rsplit(":", 1)[1])
        results = [await asyncio.to_thread(post_raw, port, f"{SESSIONS}/s{index}/step", 64 * MB,
                                           declare=index % 8 == 0)
                   for index in range(48)]
    for status, response, sent in results:
        assert status == 413 and response.rstrip().endswith(b'"code":413}}'), response[-300:]
        assert sent < 32 * MB  # the client stopped once it saw the answer


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The sizes of the pictures Pillow decodes (ImageFile.load) while the test runs; the gateway
    serves from a thread of this process, so its decodes are seen here."""
    from PIL import ImageFile

    seen: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def counted(self: ImageFile.ImageFile) -> object:
        seen.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return seen


async def test_a_9000x9000_png_is_refused_from_its_header(http: httpx.AsyncClient, workers: WorkerPool,
                                                          decodes: list[tuple[int, int]]) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    png = blank_png(9000, 9000)
    assert len(png) < 300_000
    r = await http.post(f"{SESSIONS}/{sid}/step", json=body(0, images={"cam": b64(png)}))
    error = step_error(r, 413, "payload_too_large")["error"]
    assert "243000000 elements" in error["message"]
    assert decodes == []  # refused from the header: the picture was never decoded
    small = await http.post(f"{SESSIONS}/{sid}/step", json=body(0, images={"cam": b64(blank_png(32, 40))}))
    assert small.status_code == 200, small.text
    assert set(decodes) == {(32, 40)}  # a picture within the limit is decoded, and the count sees it


def _picture(kind: str) -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 12), (10, 20, 30)).save(buffer, format=kind)
    return b64(buffer.getvalue())


async def test_only_png_and_jpeg_are_decoded(http: httpx.AsyncClient, workers: WorkerPool,
                                             decodes: list[tuple[int, int]]) -> None:
    """Pillow is never asked to probe another format (EPS would run Ghostscript, TIFF/GIF hold frames)."""
    await workers.add(reference_engine())
    sid = await create(http)
    for kind in ("GIF", "BMP", "TIFF"):
        r = await http.post(f"{SESSIONS}/{sid}/step", json=body(0, images={"cam": _picture(kind)}))
        assert "not a readable picture" in step_error(r, 400, "invalid_request")["error"]["message"], kind
    assert decodes == []
    for step, kind in enumerate(("JPEG", "PNG")):
        r = await http.post(f"{SESSIONS}/{sid}/step", json=body(step, images={"cam": _picture(kind)}))
        assert r.status_code == 200 and r.json()["error"] is None, (kind, r.text)
    assert set(decodes) == {(16, 12)}  # both decoded, and the count sees them


async def test_a_malformed_body_answers_a_bounded_message(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    """One validation error per bad element, each repeating its input: the answer names ten, each
    input cut to 200 characters, and counts the rest (as vLLM's own handler does)."""
    await workers.add(reference_engine())
    sid = await create(http)
    bad = body(0)
    bad["observation"]["state"] = ["x" * 500] * 20_000
    r = await http.post(f"{SESSIONS}/{sid}/step", json=bad)
    assert r.status_code == 400 and len(r.content) < 8_000, len(r.content)
    message = r.json()["error"]["message"]
    assert message.startswith("20000 validation errors:\n") and message.endswith("...and 19990 more errors")
    assert "x" * 200 + "...[truncated]" in message and "x" * 201 not in message
    assert r.json()["error"]["param"] == "body.observation.state.0"
    number = await http.post(f"{SESSIONS}/{sid}/step", json=body(0, images={"cam": 5}))
    assert number.status_code == 400 and number.json()["error"]["param"] == "body.observation.images.cam"


def _npy_header(shape: tuple[int, ...], dtype: str = "|u1") -> bytes:
    header = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (63 - len(header) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


async def test_a_crafted_npy_header_answers_4xx_not_500(http: httpx.AsyncClient, workers: WorkerPool) -> None:
    await workers.add(reference_engine())
    sid = await create(http)
    url = f"{SESSIONS}/{sid}/step"
    thirty_gb = _npy_header((100_000, 100_000, 3))
    assert len(thirty_gb) <= 160
    step_error(await http.post(url, json=body(0, images={"cam": b64(thirty_gb)})), 413, "payload_too_large")
    short = _npy_header((24, 32, 3)) + bytes(100)  # declares 2304 bytes, holds 100
    assert "holds 100 bytes" in step_error(await http.post(url, json=body(0, images={"cam": b64(short)})), 400,
                                           "invalid_request")["error"]["message"]
    floats = _npy_header((2, 2, 3), "<f8") + bytes(96)
    step_error(await http.post(url, json=body(0, images={"cam": b64(floats)})), 400, "invalid_request")
    objects = _npy_header((1,), "|O") + bytes(8)
    step_error(await http.post(url, json=body(0, images={"cam": b64(objects)})), 400, "invalid_request")
    assert (await http.get(f"{SESSIONS}/{sid}/status")).json()["committed_step_id"] == -1


@pytest.fixture
def roomy(redis_server: RedisServer, prefix: str) -> Iterator[GatewayServer]:
    """A gateway whose limits let a 7000x7000 picture through to its (slow) decode."""
    yield GatewayServer(redis_server.url, prefix, limits=Limits(max_array_elements=160_000_000))


async def test_a_big_decode_does_not_stall_other_clients(roomy: GatewayServer, workers: WorkerPool) -> None:
    await workers.add(NullEngine())
    # 0.4-3 s to decode, by the machine: long enough for several status calls on a fast one
    png = b64(blank_png(7000, 7000))
    async with roomy as server, httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        sid = await create(http, model="null-world")
        wrong = body(0, images={"cam": png})
        wrong["action"]["joint_positions"] = [0.0]  # refused after the decode: nothing is enqueued
        began = time.perf_counter()
        heavy = [asyncio.create_task(http.post(f"{SESSIONS}/{sid}/step", json=wrong)) for _ in range(2)]
        waits: list[float] = []
        while not all(task.done() for task in heavy):
            started = time.perf_counter()
            assert (await http.get(f"{SESSIONS}/{sid}/status")).status_code == 200
            waits.append(time.perf_counter() - started)
            await asyncio.sleep(0.005)  # often enough to see the loop several times on a fast machine
        total = time.perf_counter() - began
        for task in heavy:
            step_error(task.result(), 400, "invalid_request")
    # Relative to the decodes' own time, so a loaded machine does not decide it: decoded on the event
    # loop, the two would run one after the other and one status call would wait about half of it.
    assert len(waits) > 5 and max(waits) < total / 3, \
        f"status waited up to {max(waits):.2f}s of {total:.2f}s behind a decode"


async def test_a_step_the_fleet_never_answers_is_a_504(redis_server: RedisServer, prefix: str,
                                                       workers: WorkerPool) -> None:
    await workers.add(NullEngine(NullEngineConfig(delay_ms=3_000)))
    async with GatewayServer(redis_server.url, prefix, step_timeout=0.5) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as http:
        sid = await create(http, model="null-world")
        r = await http.post(f"{SESSIONS}/{sid}/step", json=body(0))
        data = step_error(r, 504, "timeout")
        assert data["error"]["committed_step_id"] == -1 and "no result within 0.5s" in data["error"]["message"]

