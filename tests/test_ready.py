"""A worker process's ``/ready`` (Kubernetes' readiness probe, on the ``/metrics`` port): 503 with a
one-line reason while its engine is not ready, 200 once the engine answers and the worker is
registered, 503 again when its heartbeats no longer reach Redis, and 503 while it drains after
SIGTERM (its in-flight step still finishes)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker import FleetClient
from broker.redis.embedded import RedisServer, free_port, running_redis
from tests.procs import Fleet

MODEL = "policy"
HOLD_S = 5.0  # how long the holding engine keeps its step: the drain waits for it


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


@pytest.mark.slow  # a reference worker process (torch import, engine start)
async def test_ready_says_draining_after_sigterm_while_the_step_in_flight_finishes(
        redis_server: RedisServer, prefix: str, tmp_path: Path) -> None:
    port, held = free_port(), tmp_path / "held"
    procs = Fleet(redis_server.url, prefix)
    try:
        options = {"latent_shape": "[1,4,2,8,10]", "lm": '{"eos_token_id":-1}', "hold_after": "3",
                   "hold_s": str(HOLD_S), "signal_path": str(held)}
        worker = procs.worker(*[f"--engine-opt={key}={value}" for key, value in options.items()],
                              "--metrics-port", str(port), "--drain-timeout", "10",
                              engine="tests.holding_engine:HoldingEngine")
        assert await until_ready_says(port, 200, "ready") == "ready\n"
        async with FleetClient(redis_server.url, prefix=prefix) as fleet:
            s = await fleet.create_session(model="reference-lm", mode="tokens")
            running = s.submit(0, token_ids=[257, 260, 72], sampling={"max_tokens": 8, "seed": 7})
            deadline = time.monotonic() + 60
            while not held.exists():
                assert time.monotonic() < deadline and not running.done(), "the step never held"
                await asyncio.sleep(0.02)
            worker.send_signal(signal.SIGTERM)
            # Draining lasts the held step, then the drain timeout: its session has nowhere to go.
            assert await until_ready_says(port, 503, "worker draining") == "worker draining\n"
            result = await asyncio.wait_for(running, 60)
        assert result.ok, result.error  # the drain finished the step it had
        assert await asyncio.to_thread(worker.wait, 60) == 0
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired, Exception):
            procs.close()
