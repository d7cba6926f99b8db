"""How many of the project's files one steady-state step crosses, on the trainer side and the worker side.

A private redis-server on a free port, one worker (reference engine) on a thread of its own with its
own event loop, and a trainer on the main thread. After a few warm-up steps, exactly one
``Session.step`` is traced on the trainer side, and the worker's handling of that one job (inbox
read, lane, executor, engine, commit, reply) on the worker side, with ``sys.settrace`` (and
``threading.settrace`` for the worker's threads) filtered to files under ``schemas/``, ``broker/``,
``workers/`` and ``cli/``. The worker's background loops (heartbeat, readiness, weight control,
idle sweep, reaper, rebalancer) are left out: they are not the step.

For each side it prints the distinct files entered and their count, and how many times the trace
came back to a file it had already left ("returns to rooms it already left"). A side's trace is cut
into strands, one per asyncio task (or thread, off the loop): each strand is the sequence of files
its executed lines are in, repeats collapsed, and a return is an element of that sequence that
appeared earlier in it. The counts are summed over the strands.

    python -m bench.step_files [--json] [--warmup 4] [--sequence]

A measurement of the code's shape, not of speed; it is a tool of the checkout, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench.common import new_prefix, private_redis, world_inputs
from broker import FleetClient
from workers.engines.reference import ReferenceEngine
from workers.settings import WorkerSettings
from workers.worker import Worker

REPO = Path(__file__).resolve().parent.parent
ROOMS = ("schemas", "broker", "workers", "cli")
WORKER_THREAD = "step-files-worker"  # its loop's default executor threads are "step-files-worker-exec_N"
# The worker's loops that are not the step (the names Worker._spawn gives them).
BACKGROUND = frozenset({"heartbeat", "readiness", "control", "idle-sweep", "reaper", "rebalance"})
STEP_TIMEOUT_S = 60.0  # one step of the reference engine on a slow, shared CPU
START_TIMEOUT_S = 120.0  # the worker's start builds the reference models
STOP_TIMEOUT_S = 30.0
MODEL, MODE = "reference-world", "world_model_env"

Tracer = Callable[[FrameType, str, Any], Any]


@dataclass
class Side:
    """The files one side's traced strands went through, in order."""

    name: str
    active: bool = False
    strands: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def note(self, room: str, strand: tuple[int, int]) -> None:
        path = self.strands.setdefault(strand, [])
        if not path or path[-1] != room:
            path.append(room)

    def report(self) -> dict[str, Any]:
        files = sorted({room for path in self.strands.values() for room in path})
        returns = 0
        for path in self.strands.values():
            seen: set[str] = set()
            for room in path:
                returns += room in seen
                seen.add(room)
        rooms = {room: sum(path.split("/")[0] == room for path in files) for room in ROOMS}
        return {"files": files, "count": len(files), "returns": returns, "strands": len(self.strands),
                "by_room": {room: count for room, count in rooms.items() if count}}


class StepTrace:
    """The trace functions: a global one that picks the frames of our rooms on an active side, and
    a local one that notes the file of each line those frames run."""

    def __init__(self) -> None:
        self.trainer = Side("trainer")
        self.worker = Side("worker")
        self._rooms: dict[str, str | None] = {}

    def room(self, filename: str) -> str | None:
        if filename not in self._rooms:
            try:
                rel = Path(filename).resolve().relative_to(REPO)
            except ValueError:
                rel = None
            self._rooms[filename] = str(rel) if rel is not None and rel.parts[0] in ROOMS else None
        return self._rooms[filename]

    def side(self) -> Side | None:
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return self.trainer
        if thread.name.startswith(WORKER_THREAD):
            return self.worker
        return None

    @staticmethod
    def strand() -> tuple[int, int] | None:
        """(thread, task) of the running code; None for a background loop of the worker."""
        task = asyncio.current_task() if asyncio._get_running_loop() is not None else None
        if task is not None and task.get_name() in BACKGROUND:
            return None
        return threading.get_ident(), id(task) if task is not None else 0

    def global_trace(self, frame: FrameType, event: str, arg: Any) -> Tracer | None:
        side = self.side()
        if event != "call" or side is None or not side.active:
            return None
        room = self.room(frame.f_code.co_filename)
        strand = self.strand() if room is not None else None
        if room is None or strand is None:
            return None
        side.note(room, strand)

        def local_trace(frame: FrameType, event: str, arg: Any) -> Tracer | None:
            if event == "line" and side.active:
                side.note(room, strand)
            return local_trace

        return local_trace


@dataclass
class WorkerThread:
    """One worker serving on a thread with its own event loop; every wait on it is bounded."""

    url: str
    prefix: str
    started: threading.Event = field(default_factory=threading.Event)
    worker: Worker | None = None
    loop: asyncio.AbstractEventLoop | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Worker:
        self.thread = threading.Thread(target=self._main, name=WORKER_THREAD, daemon=True)
        self.thread.start()
        if not self.started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the worker did not start within {START_TIMEOUT_S:g}s")
        if self.error is not None or self.worker is None:
            raise RuntimeError(f"the worker failed to start: {self.error!r}")
        return self.worker

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the main thread
            self.error = exc
            self.started.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        threads = concurrent.futures.ThreadPoolExecutor(thread_name_prefix=f"{WORKER_THREAD}-exec")
        self.loop.set_default_executor(threads)
        settings = WorkerSettings.from_mapping({"redis_url": self.url, "prefix": self.prefix, "handover_on_stop": False,
                                                "rebalance_interval_s": 0.0, "drain_timeout_s": 5.0})
        worker = Worker(ReferenceEngine(), settings)
        await worker.start()
        self.worker = worker
        self.started.set()
        try:
            await worker.serve()
        finally:
            await worker.shutdown()

    def idle(self) -> bool:
        """No job of the worker's is running (its ``_active`` count, read across threads)."""
        return self.worker is not None and self.worker._active == 0

    def stop(self) -> None:
        if self.loop is not None and self.worker is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.worker.request_stop)
        if self.thread is not None:
            self.thread.join(STOP_TIMEOUT_S)
            if self.thread.is_alive():
                raise TimeoutError(f"the worker did not stop within {STOP_TIMEOUT_S:g}s")


async def wait_until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        await asyncio.sleep(0.005)


async def trace_one_step(url: str, prefix: str, worker: WorkerThread, trace: StepTrace, warmup: int) -> None:
    async with FleetClient(url, prefix=prefix) as fleet:
        session = await asyncio.wait_for(fleet.create_session(model=MODEL, mode=MODE), STEP_TIMEOUT_S)
        for step in range(warmup):
            result = await asyncio.wait_for(session.step(step, **world_inputs(step)), STEP_TIMEOUT_S)
            if not result.ok:
                raise RuntimeError(f"warm-up step {step} failed: {result.error}")
        await wait_until(worker.idle, "the worker did not finish its warm-up jobs", STEP_TIMEOUT_S)
        inputs = world_inputs(warmup)
        trace.worker.active = trace.trainer.active = True
        try:
            result = await asyncio.wait_for(session.step(warmup, **inputs), STEP_TIMEOUT_S)
        finally:
            trace.trainer.active = False
        try:  # the worker's lane goes on a moment after the reply (metrics, the lane's end)
            await wait_until(worker.idle, "the worker did not finish the traced job", STEP_TIMEOUT_S)
        finally:
            trace.worker.active = False
        if not result.ok:
            raise RuntimeError(f"the traced step failed: {result.error}")
        await asyncio.wait_for(session.close(), STEP_TIMEOUT_S)


def measure(warmup: int) -> StepTrace:
    trace = StepTrace()
    with private_redis() as server:
        prefix = new_prefix("files")
        threading.settrace(trace.global_trace)  # the worker's threads, started after this
        sys.settrace(trace.global_trace)
        worker = WorkerThread(server.url, prefix)
        try:
            worker.start()
            asyncio.run(trace_one_step(server.url, prefix, worker, trace, warmup))
        finally:
            sys.settrace(None)
            threading.settrace(None)
            worker.stop()
    return trace


def format_side(name: str, report: dict[str, Any]) -> str:
    lines = [f"{name} side: {report['count']} files, {report['returns']} returns to rooms it already left "
             f"({report['strands']} strands); by room: "
             + ", ".join(f"{room} {count}" for room, count in report["by_room"].items())]
    lines += [f"  {path}" for path in report["files"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_files", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the traced one (default 4)")
    parser.add_argument("--sequence", action="store_true", help="also print each strand's sequence of files")
    args = parser.parse_args(argv)
    trace = measure(args.warmup)
    sides = {"trainer": trace.trainer, "worker": trace.worker}
    report = {name: side.report() for name, side in sides.items()}
    if args.sequence:
        for name, side in sides.items():
            report[name]["sequences"] = list(side.strands.values())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, side in sides.items():
        print(format_side(name, report[name]))
        if args.sequence:
            for path in side.strands.values():
                print("  strand: " + " > ".join(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
