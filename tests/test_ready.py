"""A worker process's ``/ready`` (Kubernetes' readiness probe, on the ``/metrics`` port): 503 with a
one-line reason while its engine is not ready, 200 once the engine answers and the worker is
registered, 503 again when its heartbeats no longer reach Redis."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from broker.redis.embedded import RedisServer, free_port, running_redis
from tests.procs import Fleet

MODEL = "policy"


class FakeVLLMHealth(ThreadingHTTPServer):
    """A stand-in for a vLLM server's ``GET /health`` only: ``status`` is what it answers (every
    other path answers 404, which the vllm-http engine reads as "no weight version yet")."""

    status = 503


class _Health(BaseHTTPRequestHandler):
    server: FakeVLLMHealth

    def do_GET(self) -> None:
        self.send_response(self.server.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def vllm_health() -> Iterator[FakeVLLMHealth]:
    server = FakeVLLMHealth(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: the test stops it."""
    with running_redis() as server:
        yield server


async def ready_answer(port: int) -> tuple[int, str] | None:
    """``/ready``'s status and body, or None while nothing listens yet."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            response = await http.get(f"http://127.0.0.1:{port}/ready")
    except httpx.TransportError:
        return None
    return response.status_code, response.text


async def until_ready_says(port: int, status: int, starts: str, timeout: float = 60.0) -> str:
    """Poll ``/ready`` until it answers ``status`` with a body starting with ``starts``; the body."""
    deadline = time.monotonic() + timeout
    last: tuple[int, str] | None = None
    while time.monotonic() < deadline:
        last = await ready_answer(port)
        if last is not None and last[0] == status and last[1].startswith(starts):
            return last[1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"/ready did not answer {status} {starts!r} within {timeout:g}s; last: {last}")


async def test_ready_follows_the_engine_registration_and_redis(own_redis: RedisServer,
                                                               vllm_health: FakeVLLMHealth) -> None:
    port = free_port()
    procs = Fleet(own_redis.url, "ready")
    try:
        procs.worker("--engine-opt", f"base_url=http://127.0.0.1:{vllm_health.server_port}",
                     "--engine-opt", f"model={MODEL}", "--metrics-port", str(port), engine="vllm-http")
        body = await until_ready_says(port, 503, "engine not ready:")
        assert body.count("\n") == 1 and body.endswith("\n"), body  # one line
        vllm_health.status = 200
        assert await until_ready_says(port, 200, "ready") == "ready\n"
        own_redis.stop()
        body = await until_ready_says(port, 503, "heartbeat failed:")
        assert body.count("\n") == 1, body
        # /metrics is still served beside it, with the engine's own gauge.
        async with httpx.AsyncClient(timeout=5.0) as http:
            metrics = await http.get(f"http://127.0.0.1:{port}/metrics")
        assert metrics.status_code == 200 and "rollout_fleet_engine_ready 1.0" in metrics.text
    finally:
        with contextlib.suppress(Exception):
            procs.close()
