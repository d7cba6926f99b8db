"""CPU per step, this checkout against an earlier revision on the same machine in the same run.

A CPU figure from another machine, or another hour of a shared one, is no baseline: the same
benchmark measured 589 µs per tiny step on one VM of this project and 200 µs on another. So the
revision to compare with is checked out (a temporary ``git worktree``) and measured here, rounds
alternating between the two checkouts, each case in a fresh child process
(bench/step_cpu_child.py) with one null-engine worker, against one private Redis:

- ``tiny``: 256 closed-loop sessions, a float32 (1, 4) result (the throughput benchmark's case);
- ``latent``: 64 closed-loop sessions, a float32 (1, 16, 2, 44, 80) result (450 KB).

Rows give the median over the rounds of steps/s and of the CPU per step of the trainer process,
the worker and Redis (``/proc/<pid>/stat`` over the timed window), then the ratio of the totals.

    python -m bench.step_cpu --size full --baseline 012b13f
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
from bench.step_cpu_child import CASES
from broker.redis.embedded import RedisServer

NAME = "step_cpu"
CHILD = Path(__file__).resolve().parent / "step_cpu_child.py"
_CHILD_SLACK_S = 120.0  # worker start and session creation, beyond warm-up and window


@dataclass(frozen=True)
class Size:
    warmup_s: float
    window_s: float
    rounds: int


SIZE = {"smoke": Size(warmup_s=0.3, window_s=0.5, rounds=1), "full": Size(warmup_s=1.0, window_s=4.0, rounds=3)}


def measure(root: Path, server: RedisServer, case: str, size: Size) -> dict[str, float]:
    """One case in a child process that imports the fleet from ``root``."""
    assert server.process is not None
    command = [sys.executable, str(CHILD), "--redis-url", server.url, "--redis-pid", str(server.process.pid),
               "--prefix", new_prefix("cpu"), "--case", case,
               "--warmup-s", str(size.warmup_s), "--window-s", str(size.window_s)]
    done = subprocess.run(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=size.warmup_s + size.window_s + _CHILD_SLACK_S)
    if done.returncode != 0:
        raise RuntimeError(f"{case} at {root} failed ({done.returncode}): {done.stderr[-2000:]}")
    values: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return values


def rows_of(samples: dict[tuple[str, str], list[dict[str, float]]], labels: Sequence[str], rounds: int) -> list[Row]:
    rows = []
    for case in CASES:
        shape, sessions = CASES[case]
        title = f"{case} {shape} f32, {sessions} sessions, 1 worker"
        medians = {}
        for label in labels:
            runs = samples[(case, label)]
            medians[label] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            rows.append(Row(NAME, title, f"fleet @ {label}", medians[label], "",
                            f"median of {rounds} alternated round(s)"))
        if len(labels) == 2:
            now, then = (medians[label] for label in labels)
            rows.append(Row(NAME, title, f"{labels[0]} / {labels[1]}",
                            {"cpu_total": now["cpu_us_total"] / then["cpu_us_total"],
                             "steps_s": now["steps_s"] / then["steps_s"]}, "x"))
    return rows


def run(size_name: str, baseline: str | None) -> list[Row]:
    size = SIZE[size_name]
    with contextlib.ExitStack() as stack:
        roots = {"this checkout": REPO}
        if baseline is not None:
            roots[f"{baseline}"] = stack.enter_context(checkout_of(baseline))
        server = stack.enter_context(private_redis())
        samples: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(size.rounds):
            for case in CASES:
                for label, root in roots.items():
                    samples.setdefault((case, label), []).append(measure(root, server, case, size))
        return rows_of(samples, list(roots), size.rounds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="smoke")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to measure beside this checkout")
    args = parser.parse_args(argv)
    print(format_table(run(args.size, args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
