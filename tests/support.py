"""Helpers for tests: in-process workers and small inputs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from broker.ops.failover import reap, sessions_of
from broker.redis.embedded import free_port
from broker.redis.scripts import Scripts
from workers.engines.base import Engine
from workers.settings import WorkerSettings
from workers.worker import Worker

FAST = {"heartbeat_ms": 100, "lease_ms": 500}  # worker settings for quick failover in tests
STOP_TIMEOUT_S = 60.0  # drain (30 s at most) plus handover, with room for a loaded machine
KILL_TIMEOUT_S = 10.0  # a killed worker's tasks are cancelled: they end at once or never


def task_stacks() -> str:
    """Where every asyncio task of this loop is waiting (for a hang's failure message): each task's
    chain of awaits, outermost first, down to the future it is suspended on."""
    lines: list[str] = []
    for task in asyncio.all_tasks():
        lines.append(f"  {task.get_name()}: {' -> '.join(_await_chain(task.get_coro())) or '(no frames)'}")
    return "\n".join(sorted(lines))


def _await_chain(coro: Any, depth: int = 40) -> list[str]:
    where: list[str] = []
    while coro is not None and depth > 0:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            if isinstance(coro, asyncio.Future):
                where.append(f"<{type(coro).__name__}>")
            break
        where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        depth -= 1
    return where


async def until(check: Callable[[], Awaitable[bool]], what: str | Callable[[], Awaitable[Any]],
                bound_s: float = 60.0, poll_s: float = 0.05) -> None:
    """Poll ``check`` until it holds; AssertionError after ``bound_s`` with ``what`` (or what the
    coroutine function ``what`` answers then: the state that explains the wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not await check():
        if loop.time() >= deadline:
            raise AssertionError(what if isinstance(what, str) else await what())
        await asyncio.sleep(poll_s)


async def equals(value: Awaitable[object], expected: object) -> bool:
    """``until``'s check that an awaited value (a Redis read) equals ``expected``."""
    return await value == expected


async def reap_until_moved(scripts: Scripts, dead: str, timeout: float = 5.0, lease_ms: int = FAST["lease_ms"]) -> None:
    """Run the reaper until the sessions of worker ``dead`` have moved."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        reports = await reap(scripts, lease_ms=lease_ms)
        if any(r.worker_id == dead and r.retired for r in reports):
            return
        # Workers reap too (workers/reaper.py): the pass that retired it may have been theirs.
        if await scripts.redis.zscore(scripts.keys.workers, dead) is None and not await sessions_of(scripts, dead):
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"{dead} was not failed over")


@dataclass
class RunningWorker:
    worker: Worker
    task: asyncio.Task[None]

    @property
    def id(self) -> str:
        return self.worker.id


@dataclass
class WorkerPool:
    url: str
    prefix: str
    running: list[RunningWorker] = field(default_factory=list)

    async def add(self, engine: Engine, **overrides: Any) -> RunningWorker:
        """An in-process worker. Rebalancing is off unless asked for (``rebalance_interval_s``): a
        test that places sessions and checks where they are must not race a rebalancing pass."""
        settings = WorkerSettings.from_mapping({"redis_url": self.url, "prefix": self.prefix,
                                                "rebalance_interval_s": 0.0, **overrides})
        worker = Worker(engine, settings)
        await worker.start()
        task = asyncio.create_task(worker.serve())
        running = RunningWorker(worker, task)
        self.running.append(running)
        return running

    async def stop(self, running: RunningWorker, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM path, bounded: a worker that does not stop in time is killed and the test fails
        with every task's stack, so a hang names itself instead of eating the run's timeout."""
        running.worker.request_stop()
        await self._within(running, running.task, "serve", timeout_s)
        await self._within(running, asyncio.ensure_future(running.worker.shutdown()), "shutdown", timeout_s)
        self.running.remove(running)

    async def _within(self, running: RunningWorker, step: asyncio.Future[None], phase: str, timeout_s: float) -> None:
        await asyncio.wait({step}, timeout=timeout_s)
        if step.done():
            step.result()
            return
        stacks = task_stacks()  # before any cancel: it would unwind the very frames that hang
        step.cancel()
        with contextlib.suppress(TimeoutError):  # a task that ignores its cancel must not hide the stacks
            await asyncio.wait_for(self.kill(running), KILL_TIMEOUT_S)
        raise AssertionError(f"worker {running.id} did not stop within {timeout_s}s ({phase}); tasks:\n{stacks}")

    async def kill(self, running: RunningWorker) -> None:
        """Die like SIGKILL: no drain, no handover, no deregistration; the heartbeat just stops."""
        worker = running.worker
        running.task.cancel()
        for task in list(worker._tasks):
            task.cancel()
        await asyncio.gather(running.task, *worker._tasks, return_exceptions=True)
        if worker._redis is not None:
            if worker._scripts is not None:
                await worker._scripts.cancel_pending()
            await worker._redis.aclose()
            worker._redis = None
        self.running.remove(running)

    async def stop_all(self) -> None:
        """Teardown: drain without waiting for capacity elsewhere (a drain that finds none keeps
        serving for its whole drain timeout, workers/drain.py); nothing checks these sessions now."""
        failures: list[AssertionError] = []
        for running in list(self.running):
            worker = running.worker
            worker.settings = dataclasses.replace(worker.settings, drain_timeout_s=0.0)
            try:
                await self.stop(running)
            except AssertionError as exc:
                failures.append(exc)
            except Exception:  # a worker that failed on its own is stopped all the same
                continue
        if failures:
            raise failures[0]


@contextlib.asynccontextmanager
async def worker_pool(url: str, prefix: str) -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(url, prefix)
    try:
        yield pool
    finally:
        await pool.stop_all()


def image(seed: int = 0, h: int = 24, w: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def world_step(i: int, prompt: str = "pick the cup", seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of Session.step for a world-model step."""
    return {
        "observation": {
            "prompt": prompt,
            "images": {"observation/exterior_image_1_left": image(seed * 1000 + i)},
            "state": [0.01 * i] * 8,
        },
        "action": {"joint_positions": [0.1 * ((i + j) % 5) for j in range(7)], "gripper_position": [0.5]},
    }


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``rollout-fleet ARGV`` in a thread (it runs its own event loop), with no environment:
    exit code, stdout, stderr."""
    from cli.main import main  # the CLI pulls in every verb: only the tests that run it pay

    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv), {})
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@contextlib.asynccontextmanager
async def cli_http_server(argv: list[str], env: dict[str, str], path: str,
                          ready: Callable[[httpx.Response], bool]) -> AsyncIterator[httpx.AsyncClient]:
    """``rollout-fleet ARGV --port P`` (gateway, dashboard) as its own process, on a free port: a
    client for it once ``GET path`` answers as ``ready`` says (at most 60 s, or until the process
    exits); the process is stopped on the way out."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *argv, "--port", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as http:
            last = "no answer"
            for _ in range(300):  # bounded: imports and uvicorn's start take seconds
                if proc.poll() is not None:
                    break
                with contextlib.suppress(httpx.TransportError):
                    answer = await http.get(path)
                    if ready(answer):
                        break
                    last = f"{answer.status_code} {answer.text}"
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"{argv[0]}: GET {path} never answered as expected: {last}")
            if proc.poll() is not None:
                raise AssertionError(f"{argv[0]} exited {proc.returncode}: {proc.communicate(timeout=10)[1]}")
            yield http
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


async def stop_supervisor(supervisor: Any, task: asyncio.Task[None], timeout: float = 10.0) -> None:
    """Stop an arq supervisor started with ``async_run`` in a test.

    arq's ``close`` cancels the jobs still running and then gathers them, so a job finishing its last
    write (its result is already visible) makes ``close`` raise CancelledError and leaks the job's
    connection. Jobs get ``timeout`` seconds to finish first."""
    running = [t for t in supervisor.tasks.values() if not t.done()]
    if running:
        await asyncio.wait(running, timeout=timeout)
    try:
        await supervisor.close()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
