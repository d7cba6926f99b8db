"""The cyclic garbage collector's time in a fleet worker and its trainer, with the worker's tuning
(``workers.runner.tune_gc``) and without it.

64 closed-loop sessions on one null-engine worker, tiny and 450 KB latent results. Every
collection of both processes is timed with ``gc.callbacks``: the worker runs through this module
(``--child``), which records its collections and writes out those of the window, and with
``--default-gc`` replaces ``tune_gc`` by nothing, so the same code runs with Python's defaults.
Rows: per generation, collections in the timed window, their total and longest time, and the
trainer's step latency.

    python -m bench.gc_pauses --size full
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from bench.common import (
    LATENT_SHAPE,
    TINY_SHAPE,
    Children,
    Latencies,
    Row,
    module_main,
    new_prefix,
    private_redis,
    wait_fleet_workers,
    world_inputs,
)
from broker import FleetClient
from cli import processes

NAME = "gc_pauses"
SESSIONS = 64


@dataclass(frozen=True)
class Size:
    window_s: float
    rounds: int


SIZE = {"smoke": Size(window_s=1.0, rounds=1), "full": Size(window_s=15.0, rounds=2)}


class CollectionTimer:
    """Every collection's generation and duration, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.times.append((int(info["generation"]), (time.perf_counter() - self._started) * 1000.0))

    def summary(self, since: int = 0, until: int | None = None) -> dict[str, float]:
        """Collections ``since`` .. ``until`` (indexes into ``times``): count, total and longest ms
        per generation."""
        out: dict[str, float] = {}
        for gen, name in enumerate(("young", "middle", "full")):
            ms = [t for g, t in self.times[since:until] if g == gen]
            out |= {f"{name}_n": float(len(ms)), f"{name}_ms": sum(ms), f"{name}_max_ms": max(ms, default=0.0)}
        return out


def run_child(argv: list[str]) -> int:
    """A worker (``cli.main`` arguments after ``--``) whose collections are timed: SIGUSR1 starts
    the window, a second SIGUSR1 writes the window's summary to ``--out``."""
    out, default_gc = argv[argv.index("--out") + 1], "--default-gc" in argv
    timer = CollectionTimer()
    gc.callbacks.append(timer)
    marks: list[int] = []

    def mark(*_: object) -> None:
        marks.append(len(timer.times))
        if len(marks) == 2:
            with open(out + ".part", "w", encoding="utf-8") as f:
                json.dump(timer.summary(marks[0], marks[1]), f)
            os.replace(out + ".part", out)  # whole or absent: the bench polls for it

    signal.signal(signal.SIGUSR1, mark)
    if default_gc:
        from workers import runner

        runner.tune_gc = lambda: None  # the worker as it ran before its tuning
    from cli.main import main

    return main(argv[argv.index("--") + 1 :])


async def one_round(url: str, latent: bool, default_gc: bool, window_s: float) -> list[Row]:
    prefix, shape = new_prefix("gc"), LATENT_SHAPE if latent else TINY_SHAPE
    out = os.path.join(tempfile.gettempdir(), f"gc-pauses-{prefix}.json")
    worker_args = processes.worker_command(url, prefix, latent_shape=shape)
    cli_args = worker_args[worker_args.index("cli.main") + 1 :]
    with Children() as children:  # one per round: a killed worker of an earlier round is no error
        proc = children.spawn([sys.executable, "-m", "bench.gc_pauses", "--child", "--out", out,
                               *(["--default-gc"] if default_gc else []), "--", *cli_args])
        worker, lat, trainer = await _measure(url, prefix, window_s, proc, children, out)
    return _rows(f"{'latent' if latent else 'tiny'} x{SESSIONS}, {window_s:g} s", default_gc, worker, lat, trainer)


async def _measure(url: str, prefix: str, window_s: float, proc: processes.Process, children: Children,
                   out: str) -> tuple[dict[str, float], Latencies, dict[str, float]]:
    """The worker's collections in the window, the trainer's latencies and collections."""
    try:
        await wait_fleet_workers(url, prefix, 1, children)
        trainer = CollectionTimer()
        gc.callbacks.append(trainer)
        try:
            lat, before = await _drive(url, prefix, window_s, trainer, proc.pid)
        finally:
            gc.callbacks.remove(trainer)
        return await _read_when_written(out), lat, trainer.summary(before)
    finally:
        proc.kill()  # its summary is written: no drain needed
        await asyncio.to_thread(proc.wait, 30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out)


def _rows(case: str, default_gc: bool, worker: dict[str, float], lat: Latencies,
          trainer: dict[str, float]) -> list[Row]:
    gc_mode = "python defaults" if default_gc else "tuned (workers.runner.tune_gc)"
    return [Row(NAME, case, f"worker, {gc_mode}", worker, "", "collections in the window; ms"),
            Row(NAME, case, f"trainer (python defaults), beside a {gc_mode} worker",
                trainer | lat.summary(), "", "collections in the window; ms")]


async def _read_when_written(path: str, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker wrote no collection summary to {path} in {timeout_s:g} s")
        await asyncio.sleep(0.05)
    with open(path, encoding="utf-8") as f:
        summary: dict[str, float] = json.load(f)
    return summary


async def _drive(url: str, prefix: str, window_s: float, trainer: CollectionTimer,
                 worker_pid: int) -> tuple[Latencies, int]:
    """Step every session closed loop for the window, which the worker is told of (SIGUSR1); the
    latencies, and how many of the trainer's collections came before it (session creation is not
    timed)."""
    lat = Latencies()
    async with FleetClient(url, prefix=prefix) as fleet:
        sessions = await asyncio.gather(*(fleet.create_session("null-world", "world_model_env")
                                          for _ in range(SESSIONS)))
        before = len(trainer.times)
        os.kill(worker_pid, signal.SIGUSR1)
        stop = time.monotonic() + window_s

        async def drive(session: Any) -> None:
            k = 0
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                result = await session.step(k, **world_inputs(k))
                if not result.ok:
                    raise RuntimeError(f"step {k} failed: {result.error}")
                lat.samples_ms.append((time.perf_counter() - t0) * 1000.0)
                k += 1

        await asyncio.gather(*(drive(s) for s in sessions))
        os.kill(worker_pid, signal.SIGUSR1)
    return lat, before


async def run(size: str) -> list[Row]:
    sz = SIZE[size]
    rows: list[Row] = []
    with private_redis() as server:
        for latent in (False, True):
            for _ in range(sz.rounds):
                for default_gc in (True, False):  # alternated: the machine's drift hits both
                    rows += await one_round(server.url, latent, default_gc, sz.window_s)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--child" in args:
        return run_child(args)
    return module_main(NAME, run, args)


if __name__ == "__main__":
    raise SystemExit(main())
