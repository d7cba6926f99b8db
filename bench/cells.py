"""What placement across cells costs: ``create_session`` latency of a client given one cell (one
script call) beside a client of every cell (the registry, each live cell's free capacity, then the
script), with 1, 3 and 8 cells on one Redis; and a step's round trip through each client (routing
by the id's cell adds no Redis call).

In-process null-engine workers (one per cell) and the client share this process: the numbers are
the client's and Redis's work, not an engine's.
"""

from __future__ import annotations

import asyncio
import time

from bench.common import Latencies, Row, module_main, new_prefix, private_redis, world_inputs
from broker import FleetClient
from workers.engines.null import NullEngine
from workers.settings import WorkerSettings
from workers.worker import Worker


async def _timed_creates(fleet: FleetClient, n: int) -> tuple[Latencies, Latencies]:
    """``n`` creates, then one step on each of the sessions: both timed."""
    creates, steps = Latencies(), Latencies()
    sessions = []
    for _ in range(n):
        started = time.perf_counter()
        sessions.append(await fleet.create_session(model="null-world", mode="world_model_env"))
        creates.samples_ms.append((time.perf_counter() - started) * 1000)
    for s in sessions:
        started = time.perf_counter()
        r = await s.step(0, **world_inputs(0))
        if r.ok:
            steps.samples_ms.append((time.perf_counter() - started) * 1000)
        else:
            steps.failed(RuntimeError(str(r.error)))
    return creates, steps


async def _case(url: str, cells: int, every: bool, n: int) -> list[Row]:
    prefix = new_prefix("cl")
    names = [f"c{i}" for i in range(cells)]
    workers = []
    for name in names:
        # drain_timeout_s 0: at the end every worker of the bench stops together, so a drain would
        # wait its whole timeout for room elsewhere (workers/drain.py) for sessions nobody needs.
        settings = WorkerSettings.from_mapping({"redis_url": url, "prefix": prefix, "cell": name,
                                                "capacity": 1_000_000, "drain_timeout_s": 0.0})
        worker = Worker(NullEngine(), settings)
        await worker.start()
        workers.append((worker, asyncio.create_task(worker.serve())))
    try:
        async with FleetClient(url, prefix=prefix, cell="*" if every else names[0]) as fleet:
            await _timed_creates(fleet, min(n, 20))  # warm-up: scripts loaded, connections open
            creates, steps = await _timed_creates(fleet, n)
    finally:
        for worker, task in workers:
            worker.request_stop()
            await task
            await worker.shutdown()
    system = "client of every cell (cell='*')" if every else "client of one cell"
    case = f"{cells} cell{'s' if cells > 1 else ''} on one Redis"
    return [Row("cells", f"create_session, {case}", system, creates.summary(), "ms"),
            Row("cells", f"step round trip, {case}", system, steps.summary(), "ms")]


async def run(size: str) -> list[Row]:
    n = 200 if size == "smoke" else 2000
    rows: list[Row] = []
    with private_redis() as server:
        rows += await _case(server.url, 1, every=False, n=n)
        for cells in (1, 3, 8):
            rows += await _case(server.url, cells, every=True, n=n)
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main("cells", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
