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
    python -m bench.step_cpu --size full --baseline 012b13f --baseline-first   # the other order

The checkout measured first in a round is favoured by up to ~10%, so a pair is measured in both
orders; ``--baseline-first`` keeps this checkout's child process driving both sides (running the
revision's own bench.step_cpu for the other order drives both with the revision's child instead).

``--callgrind`` counts instructions instead: the trainer process and the worker run under valgrind's
callgrind, every session runs a fixed number of counted steps after its warm-up, and the rows give
thousands of instructions per step of each and of both, median of the rounds. A count does not
depend on how busy the VM is, where the timed rounds of one run swing by 10-30%; what is left is
how the steps of one event-loop turn batch, which moves a tiny step's count by up to ~7% between
runs of the same code (a latent step's by under 1%). Instructions are not time (a syscall's kernel
work is not counted, a cache miss counts as one): they show what a change of the Python on either
side does, the timed run what a step costs. ~12 minutes at ``--size full``.

    python -m bench.step_cpu --size full --baseline 28e433f --callgrind
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import (
    Callgrind,
    Row,
    checkouts,
    format_table,
    new_prefix,
    private_redis,
    revision_rows,
    run_child,
)
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
COUNTED_STEPS = {"smoke": 1, "full": 8}  # per session, under callgrind
_CALLGRIND_TIMEOUT_S = 900.0


def measure(root: Path, server: RedisServer, case: str, size: Size) -> dict[str, float]:
    """One case in a child process that imports the fleet from ``root``."""
    assert server.process is not None
    command = [sys.executable, str(CHILD), "--redis-url", server.url, "--redis-pid", str(server.process.pid),
               "--prefix", new_prefix("cpu"), "--case", case,
               "--warmup-s", str(size.warmup_s), "--window-s", str(size.window_s)]
    return run_child(root, command, timeout=size.warmup_s + size.window_s + _CHILD_SLACK_S, what=case)


def count(root: Path, server: RedisServer, case: str, size_name: str, callgrind: Callgrind) -> dict[str, float]:
    """One case's instructions per step, trainer and worker, in a child process that imports the
    fleet from ``root``; both run under callgrind."""
    assert server.process is not None
    command = [*callgrind.wrapper("trainer"), sys.executable, str(CHILD), "--redis-url", server.url,
               "--redis-pid", str(server.process.pid), "--prefix", new_prefix("cpu"), "--case", case,
               "--callgrind-dir", str(callgrind.directory), "--steps", str(COUNTED_STEPS[size_name])]
    done = run_child(root, command, timeout=_CALLGRIND_TIMEOUT_S, what=f"{case} under callgrind")
    steps = done["steps"]
    client = callgrind.read(callgrind.last_dump(int(done["pid_client"]), "trainer"))["total"] / steps
    worker = callgrind.read(callgrind.last_dump(int(done["pid_workers"]), "worker"))["total"] / steps
    return {"kinstr_client": client / 1e3, "kinstr_workers": worker / 1e3, "kinstr_total": (client + worker) / 1e3,
            "steps": steps}


def run_counted(size_name: str, baseline: str | None, directory: str) -> list[Row]:
    """Each case under callgrind (``--callgrind``), rounds alternating between the checkouts as the
    timed ones do: how the steps of one event-loop turn batch still varies from run to run."""
    callgrind = Callgrind(directory)
    with contextlib.ExitStack() as stack:
        roots = checkouts(stack, baseline)
        server = stack.enter_context(private_redis())
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(SIZE[size_name].rounds):
            for case in CASES:
                for label, root in roots.items():
                    runs.setdefault((case, label), []).append(count(root, server, case, size_name, callgrind))
        rows = []
        for case in CASES:
            shape, sessions = CASES[case]
            rows += revision_rows(NAME, f"{case} {shape} f32, {sessions} sessions, 1 worker, instructions",
                                  {label: runs[(case, label)] for label in roots}, {"kinstr_total": "kinstr_total"})
        return rows


def rows_of(samples: dict[tuple[str, str], list[dict[str, float]]], labels: Sequence[str]) -> list[Row]:
    rows = []
    for case in CASES:
        shape, sessions = CASES[case]
        rows += revision_rows(NAME, f"{case} {shape} f32, {sessions} sessions, 1 worker",
                              {label: samples[(case, label)] for label in labels},
                              {"cpu_total": "cpu_us_total", "steps_s": "steps_s"})
    return rows


def run(size_name: str, baseline: str | None, baseline_first: bool = False, rounds: int | None = None) -> list[Row]:
    """``baseline_first``: the baseline measured first in each round (the order biases a pair by up
    to ~10%), with this checkout's child process driving both, as in the other order. ``rounds``:
    instead of the size's (more rounds, a steadier median on a VM whose speed wanders)."""
    size = SIZE[size_name] if rounds is None else replace(SIZE[size_name], rounds=rounds)
    with contextlib.ExitStack() as stack:
        roots = checkouts(stack, baseline)
        server = stack.enter_context(private_redis())
        order = list(reversed(roots.items())) if baseline_first else list(roots.items())
        samples: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(size.rounds):
            for case in CASES:
                for label, root in order:
                    samples.setdefault((case, label), []).append(measure(root, server, case, size))
        return rows_of(samples, list(roots))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZE), default="smoke")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to measure beside this checkout")
    parser.add_argument("--callgrind", action="store_true",
                        help="count the trainer's and the worker's instructions per step under callgrind")
    parser.add_argument("--baseline-first", action="store_true",
                        help="measure the baseline first in each round (timed runs; by default this checkout is)")
    parser.add_argument("--rounds", type=int, metavar="N", help="timed rounds instead of the size's (full: 3)")
    args = parser.parse_args(argv)
    if args.baseline_first and (args.baseline is None or args.callgrind):
        parser.error("--baseline-first needs --baseline, and applies to timed runs only")
    if args.rounds is not None and (args.rounds < 1 or args.callgrind):
        parser.error("--rounds takes a positive number, for timed runs only")
    if not args.callgrind:
        print(format_table(run(args.size, args.baseline, args.baseline_first, args.rounds)))
        return 0
    if missing := Callgrind.missing():
        print(f"{NAME}: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rollout-fleet-callgrind-") as directory:
        print(format_table(run_counted(args.size, args.baseline, directory)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
