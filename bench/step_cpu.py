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

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, checkouts, new_prefix, private_redis, revision_main, revision_rows, run_child
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
    return run_child(root, command, timeout=size.warmup_s + size.window_s + _CHILD_SLACK_S, what=case)


def rows_of(samples: dict[tuple[str, str], list[dict[str, float]]], labels: Sequence[str]) -> list[Row]:
    rows = []
    for case in CASES:
        shape, sessions = CASES[case]
        rows += revision_rows(NAME, f"{case} {shape} f32, {sessions} sessions, 1 worker",
                              {label: samples[(case, label)] for label in labels},
                              {"cpu_total": "cpu_us_total", "steps_s": "steps_s"})
    return rows


def run(size_name: str, baseline: str | None) -> list[Row]:
    size = SIZE[size_name]
    with contextlib.ExitStack() as stack:
        roots = checkouts(stack, baseline)
        server = stack.enter_context(private_redis())
        samples: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(size.rounds):
            for case in CASES:
                for label, root in roots.items():
                    samples.setdefault((case, label), []).append(measure(root, server, case, size))
        return rows_of(samples, list(roots))


def main(argv: Sequence[str] | None = None) -> int:
    return revision_main(NAME, __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
