"""Trainer processes: one benchmark case driven from several trainer processes at once.

One trainer process stepping hundreds of closed-loop sessions is CPU-bound on its own event loop
(docs/benchmarks.md), so a one-process run partly measures the trainer, not the system under test.
Here N children (``python -m bench.trainers --drive JSON``) each drive their share of the sessions
of the fleet, arq or streaq: each creates its sessions and warms up, prints ``ready``, waits for
one ``go`` line from the parent on stdin, measures, and prints one JSON line of results: steps and
its own CPU inside a timed window (throughput), or latency samples (round trip). Every wait is
bounded; every child is killed when the parent is done with it, errors too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench import arq_anchor, streaq_anchor
from bench.common import CpuMeter, Latencies, StepFn, closed_loop, timed_window, world_inputs
from broker import FleetClient

READY_TIMEOUT_S = 180.0  # sessions created and warmed up, on a loaded 2-core machine
RESULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Drive:
    """What one trainer child does. ``window_s`` > 0: count steps for that long after ``warmup``
    seconds (throughput); else ``steps`` per session after ``warmup`` steps each (round trip)."""

    system: str  # fleet | arq | streaq
    url: str
    queue: str  # the fleet's key prefix, or the anchor's queue name
    sessions: int
    tag: str  # makes the anchors' session ids of this child distinct
    latent_shape: tuple[int, ...] = (1, 4)
    warmup: float = 0.0
    window_s: float = 0.0
    steps: int = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.trainers", "--drive", json.dumps(asdict(self))]


@contextlib.asynccontextmanager
async def _handles(drive: Drive) -> AsyncIterator[tuple[list[Any], StepFn]]:
    """The child's sessions (or session ids) and one closed-loop step of the system under test."""
    shape = drive.latent_shape
    if drive.system == "fleet":
        async with FleetClient(drive.url, prefix=drive.queue) as fleet:
            sessions = await asyncio.gather(*(fleet.create_session("null-world", "world_model_env")
                                              for _ in range(drive.sessions)))

            async def fleet_step(session: Any, k: int) -> None:
                result = await session.step(k, **world_inputs(k))
                if not result.ok:
                    raise RuntimeError(result.error)

            yield list(sessions), fleet_step
        return
    sids = [f"{drive.queue}-{drive.tag}-{i}" for i in range(drive.sessions)]
    if drive.system == "arq":
        pool = await arq_anchor.connect(drive.url, drive.queue)
        try:
            async def arq_step(sid: Any, k: int) -> None:
                await arq_anchor.run_step(pool, drive.queue, sid, k, world_inputs(k), shape)

            yield sids, arq_step
        finally:
            await pool.aclose()
        return
    client, task = streaq_anchor.build(drive.url, drive.queue)
    async with client:
        async def streaq_step(sid: Any, k: int) -> None:
            await streaq_anchor.run_step(task, sid, k, world_inputs(k), shape)

        yield sids, streaq_step


async def _child(drive: Drive) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    async with _handles(drive) as (handles, step):
        warm_steps = int(drive.warmup) if drive.window_s <= 0 else 1
        await closed_loop(handles, warm_steps * len(handles), 0, step)
        print("ready", flush=True)
        go = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), READY_TIMEOUT_S)
        if go.strip() != "go":
            raise RuntimeError(f"expected 'go' from the parent, got {go!r}")
        if drive.window_s > 0:
            row = await timed_window("trainer", handles, step, drive.warmup, drive.window_s, CpuMeter({}))
            return row.values
        lat = await closed_loop(handles, drive.steps * len(handles), warm_steps, step)
        return {"samples_ms": lat.samples_ms, "errors": lat.errors, "first_error": lat.first_error}


async def _line(proc: asyncio.subprocess.Process, timeout: float, log: Any) -> bytes:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not line:  # the child exited: say why
        await asyncio.wait_for(proc.wait(), 10)
        log.seek(0)
        raise RuntimeError(f"trainer child exited {proc.returncode}: {log.read()[-2000:].decode('utf-8', 'replace')}")
    return line


async def drive_all(drives: Sequence[Drive], meter: CpuMeter | None = None) -> list[dict[str, Any]]:
    """Run one child per drive, release them together, return each child's results. In window mode
    ``meter`` (workers, Redis) is started and stopped on the children's window."""
    with contextlib.ExitStack() as stack:
        procs = []
        for drive in drives:
            log = stack.enter_context(tempfile.TemporaryFile())
            proc = await asyncio.create_subprocess_exec(*drive.command(), stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE, stderr=log)
            procs.append((proc, log))
        try:
            for proc, log in procs:
                if (await _line(proc, READY_TIMEOUT_S, log)).strip() != b"ready":
                    raise RuntimeError("trainer child did not report ready")
            for proc, _ in procs:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            loop = asyncio.get_running_loop()
            if meter is not None and drives[0].window_s > 0:
                loop.call_at(loop.time() + drives[0].warmup, meter.start)
                loop.call_at(loop.time() + drives[0].warmup + drives[0].window_s, meter.stop)
            return [json.loads(await _line(proc, RESULT_TIMEOUT_S, log)) for proc, log in procs]
        finally:
            for proc, _ in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


def split(total: int, parts: int) -> list[int]:
    """``total`` sessions over ``parts`` children, as evenly as possible (no child without one)."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def window_values(results: Sequence[dict[str, Any]], window_s: float) -> dict[str, float]:
    """Summed steps/s and the children's CPU per step (``cpu_us_client``: all trainers together)."""
    steps = sum(r["steps_s"] * window_s for r in results)
    cpu_s = sum(r.get("cpu_us_client", 0.0) * r["steps_s"] * window_s / 1e6 for r in results)
    return {"steps_s": steps / window_s, "errors": float(sum(r["errors"] for r in results)),
            "cpu_us_client": 1e6 * cpu_s / steps if steps else 0.0}


def merged_latencies(results: Sequence[dict[str, Any]]) -> Latencies:
    lat = Latencies()
    for r in results:
        lat.samples_ms += r["samples_ms"]
        lat.errors += int(r["errors"])
        lat.first_error = lat.first_error or r["first_error"]
    return lat


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainers", description=__doc__)
    parser.add_argument("--drive", required=True, help="a Drive as JSON")
    args = parser.parse_args(argv)
    raw = json.loads(args.drive)
    drive = Drive(**{**raw, "latent_shape": tuple(raw.get("latent_shape", (1, 4)))})
    values = asyncio.run(_child(drive))
    print(json.dumps(values), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
