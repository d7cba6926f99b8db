"""The fleet simulation's child processes: many in-process workers, or one trainer driving many sessions.

``python -m bench.fleet_sim_procs worker|trainer SPEC_JSON`` (bench/fleet_sim.py starts them). A child
talks back through files only: it writes ``{"ready": true}`` to its ``out`` path once its workers
are registered or its sessions created, and its final report there when it stops. A trainer
snapshots its per-cell step counters at every SIGUSR1, so the parent can mark a window's start
and end while it reads Redis's counters; SIGTERM ends either child. Every child also ends on its
own after ``max_s``, so a parent that died never leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import world_inputs
from broker import FleetClient
from broker.client.session import Session
from broker.redis.config import CellConfig
from workers.engines.null import NullEngine, NullEngineConfig
from workers.settings import WorkerSettings
from workers.worker import Worker

START_BATCH = 50  # workers started at once: 1,000 registrations at a time would stall the loop
CREATE_BATCH = 200  # session creations in flight per trainer
STOP_TIMEOUT_S = 30.0
PROGRESS_EVERY_S = 1.0  # how often a trainer that is not ready yet reports its progress


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write whole or not at all: the parent polls this file."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def _ending(max_s: float) -> tuple[asyncio.Event, float]:
    """An event set by SIGTERM, and the monotonic deadline at which the child ends regardless."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop, time.monotonic() + max_s


async def _until(stop: asyncio.Event, deadline: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------- workers


def _worker_settings(spec: dict[str, Any], cell: str) -> WorkerSettings:
    # Relaxed heartbeats and reads: the simulation's workers share two cores, a real fleet's do not;
    # each setting is reported in the output, and the idle window measures what they cost.
    config = CellConfig(redis_url=spec["url"], prefix=spec["prefix"], cell=cell, lease_ms=spec["lease_ms"])
    return WorkerSettings(cell_config=config, heartbeat_ms=spec["heartbeat_ms"], block_ms=spec["block_ms"],
                          idle_sweep_s=spec["idle_sweep_s"], handover_on_stop=False, drain_timeout_s=5.0,
                          serve_results="127.0.0.1:0" if spec.get("serve_results") else None)


def _engine(spec: dict[str, Any]) -> NullEngine:
    return NullEngine(NullEngineConfig(latent_shape=(spec["latent_floats"],), delay_ms=spec["delay_ms"]))


async def run_workers(spec: dict[str, Any]) -> None:
    stop, deadline = _ending(spec["max_s"])
    workers = [Worker(_engine(spec), _worker_settings(spec, cell))
               for cell, count in spec["cells"].items() for _ in range(count)]
    serving: list[asyncio.Task[None]] = []
    try:
        for i in range(0, len(workers), START_BATCH):
            batch = workers[i:i + START_BATCH]
            await asyncio.wait_for(asyncio.gather(*(w.start() for w in batch)), STOP_TIMEOUT_S)
            serving += [asyncio.create_task(w.serve()) for w in batch]
        write_json(spec["out"], {"ready": True, "workers": len(workers)})
        await _until(stop, deadline)
    finally:
        for worker in workers:
            worker.request_stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*serving, return_exceptions=True), STOP_TIMEOUT_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True),
                                   STOP_TIMEOUT_S)
    batches = [n for w in workers for n in w.engine.batch_sizes] if workers else []
    write_json(spec["out"], {"ready": True, "workers": len(workers), "engine_batches": len(batches),
                             "engine_items": sum(batches)})


# --------------------------------------------------------------------------- trainers


class Counters:
    """Steps and errors per cell; ``mark`` keeps a copy (the parent's SIGUSR1)."""

    def __init__(self, cells: list[str]) -> None:
        self.steps = dict.fromkeys(cells, 0)
        self.errors = 0
        self.first_error = ""
        self.error_kinds: Counter[str] = Counter()  # the failures by their first 60 characters
        self.warm = 0  # sessions past their first step (which also loads the session on its worker)
        self.marks: list[dict[str, int]] = []

    def mark(self) -> None:
        self.marks.append(dict(self.steps))


def _step_inputs(kind: str, step: int, token_len: int) -> dict[str, Any]:
    if kind == "token":
        return {"token_ids": [(step + i) % 1000 for i in range(token_len)]}
    return world_inputs(step)


async def _create(fleet: FleetClient, kind: str, count: int) -> list[Session]:
    model, mode = ("null-lm", "tokens") if kind == "token" else ("null-world", "world_model_env")
    # One stored result per session: 10,000 sessions x 450 KB x the default window would not fit.
    made: list[Session] = []
    for i in range(0, count, CREATE_BATCH):
        made += await asyncio.gather(*(fleet.create_session(model, mode, result_window=1)
                                       for _ in range(min(CREATE_BATCH, count - i))))
    return made


async def _drive(session: Session, cell: str, spec: dict[str, Any], counters: Counters,
                 stop: asyncio.Event) -> None:
    """One session, closed loop: one step in flight, the next as soon as it returns."""
    step = 0
    while not stop.is_set():
        try:
            result = await session.step(step, **_step_inputs(spec["kind"], step, spec["token_len"]))
            failure = "" if result.ok else f"{result.error}"
        except Exception as exc:  # a Redis outage: counted like a failed step
            failure = repr(exc)
        if not failure:
            counters.steps[cell] += 1
            counters.warm += step == 0
            step += 1
        else:  # the same step again; a failing fleet must not spin
            counters.errors += 1
            counters.first_error = counters.first_error or failure[:200]
            counters.error_kinds[failure[:60]] += 1
            await asyncio.sleep(0.05)


def _split(total: int, parts: list[str]) -> Iterator[tuple[str, int]]:
    for i, part in enumerate(parts):
        yield part, total // len(parts) + (1 if i < total % len(parts) else 0)


async def run_trainer(spec: dict[str, Any]) -> None:
    stop, deadline = _ending(spec["max_s"])
    counters = Counters(spec["cells"])
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, counters.mark)
    async with contextlib.AsyncExitStack() as stack:
        drives: list[asyncio.Task[None]] = []
        for cell, count in _split(spec["sessions"], spec["cells"]):
            fleet = await stack.enter_async_context(
                FleetClient(spec["url"], prefix=spec["prefix"], cell=cell, lease_ms=spec["lease_ms"],
                            session_check_s=spec["session_check_s"]))
            sessions = await _create(fleet, spec["kind"], count)
            drives += [asyncio.create_task(_drive(s, cell, spec, counters, stop)) for s in sessions]
        # Ready once every session ran its first step: the window then sees the steady state only.
        # Until then the progress goes to the out file, for the parent's error if it never gets there.
        next_report = 0.0
        while counters.warm < len(drives) and not stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() >= next_report:
                write_json(spec["out"], {"ready": False, "warm": counters.warm, "sessions": len(drives),
                                         "steps": sum(counters.steps.values()), "errors": counters.errors,
                                         "error_kinds": dict(counters.error_kinds.most_common(5))})
                next_report = time.monotonic() + PROGRESS_EVERY_S
            await asyncio.sleep(0.1)
        write_json(spec["out"], {"ready": True})
        await _until(stop, deadline)
        stop.set()
        # A step in flight ends within the client's step timeout; waiting for them keeps the
        # clients open until no task needs them.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*drives, return_exceptions=True), STOP_TIMEOUT_S)
    write_json(spec["out"], {"ready": True, "marks": counters.marks, "errors": counters.errors,
                             "first_error": counters.first_error})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("worker", "trainer"):
        print("usage: python -m bench.fleet_sim_procs worker|trainer SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[1])
    asyncio.run(run_workers(spec) if args[0] == "worker" else run_trainer(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
