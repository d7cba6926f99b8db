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

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, SIZES, Row, checkout_of, format_table, new_prefix, private_redis

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
        done = subprocess.run(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                              text=True, timeout=_CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{workers} workers at {root} failed ({done.returncode}): {done.stderr[-2000:]}")
    values: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return values


def run(size_name: str, baseline: str | None) -> list[Row]:
    size = SIZE[size_name]
    with contextlib.ExitStack() as stack:
        roots = {"this checkout": REPO}
        if baseline is not None:
            roots[baseline] = stack.enter_context(checkout_of(baseline))
        samples: dict[tuple[int, str], list[dict[str, float]]] = {}
        for _ in range(size.rounds):
            for workers in size.pools:
                for label, root in roots.items():
                    samples.setdefault((workers, label), []).append(measure(root, workers, size))
    rows = []
    for workers in size.pools:
        case = f"pool of {workers} workers, {size.creates} creates, {MOVED} sessions handed over"
        medians = {}
        for label in roots:
            runs = samples[(workers, label)]
            medians[label] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            rows.append(Row(NAME, case, f"fleet @ {label}", medians[label], "",
                            f"median of {size.rounds} alternated round(s)"))
        if len(roots) == 2:
            now, then = (medians[label] for label in roots)
            rows.append(Row(NAME, case, " / ".join(roots), {"create_us": now["create_us"] / then["create_us"],
                                                            "handover_ms": now["handover_ms"] / then["handover_ms"]},
                            "x"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="smoke")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to measure beside this checkout")
    args = parser.parse_args(argv)
    print(format_table(run(args.size, args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
