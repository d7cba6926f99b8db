"""What placement costs as a cell grows: a session create's master time, and a handover's wall time,
against the number of workers in the pool; this checkout against an earlier revision.

A create judges every worker of its pool (create.lua: heartbeat, capacity, per-pool cap, owned
count, pressure), and moving a session (a drain's handover, an expired worker's failover, a
rebalance) ranks the pool's workers first (``broker.ops.failover.placement_candidates``). Both grow
with the pool. Each pool size runs in a fresh child process (bench/placement_scale_child.py) on a
fresh private Redis, alternating between the two checkouts:

- ``create``: the master's main-thread time per create (``EVALSHA`` usec) and its commands;
- ``handover``: one worker with 10 sessions hands them all over; wall time and commands.

    python -m bench.placement_scale --size full --baseline e6a9b9a
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, checkouts, new_prefix, private_redis, revision_main, revision_rows, run_child

NAME = "placement_scale"
CHILD = Path(__file__).resolve().parent / "placement_scale_child.py"
MOVED = 10  # sessions the leaving worker hands over
_CHILD_TIMEOUT_S = 600.0  # a thousand-worker pool at an old revision: tens of seconds


@dataclass(frozen=True)
class Size:
    pools: tuple[int, ...]
    creates: int
    rounds: int


SIZE = {"smoke": Size(pools=(10, 100), creates=20, rounds=1),
        "full": Size(pools=(10, 100, 333, 1000), creates=200, rounds=3)}


def measure(root: Path, workers: int, size: Size) -> dict[str, float]:
    """One pool size, in a child process that imports the fleet from ``root``, on its own Redis."""
    with private_redis() as server:
        command = [sys.executable, str(CHILD), "--redis-url", server.url, "--prefix", new_prefix("place"),
                   "--workers", str(workers), "--creates", str(size.creates), "--moved", str(MOVED)]
        return run_child(root, command, timeout=_CHILD_TIMEOUT_S, what=f"{workers} workers")


def run(size_name: str, baseline: str | None) -> list[Row]:
    size = SIZE[size_name]
    with contextlib.ExitStack() as stack:
        roots = checkouts(stack, baseline)
        samples: dict[tuple[int, str], list[dict[str, float]]] = {}
        for _ in range(size.rounds):
            for workers in size.pools:
                for label, root in roots.items():
                    samples.setdefault((workers, label), []).append(measure(root, workers, size))
    rows = []
    for workers in size.pools:
        case = f"pool of {workers} workers, {size.creates} creates, {MOVED} sessions handed over"
        rows += revision_rows(NAME, case, {label: samples[(workers, label)] for label in roots},
                              {"create_us": "create_us", "handover_ms": "handover_ms"})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return revision_main(NAME, __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
