"""Run every benchmark (or ``--only`` some), print one table, write JSON results and a latency plot.

    python -m bench.run_all --size smoke|full [--only round_trip] [--plot docs/bench_latency.png]
        [--markdown docs/benchmarks.md]

Results go to ``bench/results/latest.json`` (gitignored). Nothing here asserts a speed: the
``targets`` rows say met or missed. ``--size smoke`` took 342 s through ``rollout-fleet bench``
on a 2-core AMD EPYC VM (2026-12-02, load average under 1; throughput 117 s, failover 69 s,
weight_update 49 s, round_trip 44 s, memory 33 s, batch_fill 20 s, cells 3 s, transport 2 s).

Interrupted (SIGINT or SIGTERM), the benchmark running is cancelled, so that its worker processes
and its Redis are stopped on the way out (``bench.common.Children``: SIGTERM, SIGKILL after 15 s);
the results measured so far are written and the exit status is 128 + the signal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import batch_fill, cells, failover, memory, round_trip, throughput, transport, weight_update
from bench import report as report_md
from bench.common import SIZES, BenchFn, Row, format_table, tune_malloc
from bench.targets import evaluate
from cli.env import EnvError, apply_env, attach_env

BENCHMARKS: dict[str, BenchFn] = {
    "round_trip": round_trip.run,
    "failover": failover.run,
    "throughput": throughput.run,
    "transport": transport.run,
    "batch_fill": batch_fill.run,
    "memory": memory.run,
    "weight_update": weight_update.run,
    "cells": cells.run,
}
RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        redis = ""
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "platform": platform.platform(), "redis": redis.strip()}


def plot(rows: Sequence[Row], path: Path) -> bool:
    """p50 and p99 round trip per system and case (log scale); False when there is nothing to plot."""
    lat = [r for r in rows if r.bench == "round_trip" and "p50" in r.values and r.unit == "ms"]
    if not lat:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in lat))
    systems = list(dict.fromkeys(r.system for r in lat))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.8 / len(systems)
    for ax, metric in zip(axes, ("p50", "p99"), strict=True):
        for i, system in enumerate(systems):
            values = {r.case: r.values[metric] for r in lat if r.system == system}
            xs = [c + i * width for c in range(len(cases)) if cases[c] in values]
            ax.bar(xs, [values[c] for c in cases if c in values], width, label=system)
        ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(cases))], cases)
        ax.set_yscale("log")
        ax.set_title(f"step round trip {metric} (ms, log scale)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="smoke")
    parser.add_argument("--only", action="append", choices=list(BENCHMARKS), metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    parser.add_argument("--results", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "latency.png", help="PNG of round-trip percentiles")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the run as markdown here: between bench.report's markers when the file "
                             "has them (docs/benchmarks.md), else the whole file")
    parser.add_argument("--malloc-tuned", action="store_true",
                        help="glibc malloc keeps large blocks (mallopt here, MALLOC_* env for every child)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_args(argv: Sequence[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    """Flags, else ROLLOUT_FLEET_<DEST> (as every verb of rollout-fleet: ``rollout-fleet bench``
    passes its arguments here), else the defaults; a bad variable is one line and exit 2."""
    parser = _parser()
    attach_env(parser, environ)
    args = parser.parse_args(argv)
    try:
        apply_env(parser, args)
    except EnvError as exc:
        parser.error(str(exc))
    return args


def _load1() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def _interruptible(received: list[int]) -> dict[int, Any]:
    """SIGINT raises KeyboardInterrupt, even where it was ignored (a shell's background job): then
    asyncio.run cancels the benchmark running, whose blocks stop its children. SIGTERM is handled
    the same way (Python's default for it ends the process at once, children left running); each
    SIGTERM is appended to ``received``. Returns the handlers replaced ({} off the main thread)."""

    def on_term(signum: int, _frame: object) -> None:
        received.append(signum)
        signal.raise_signal(signal.SIGINT)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return {}
    # asyncio.run installs its cancelling handler only over Python's default one.
    return {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
            signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, os.environ)
    if args.malloc_tuned:
        tune_malloc()
    names = args.only or list(BENCHMARKS)
    rows: list[Row] = []
    report: dict[str, Any] = {"size": args.size, "only": names, "malloc_tuned": args.malloc_tuned,
                              "machine": machine(), "started": time.time(), "wall_s": {}, "failed": [],
                              "loadavg": {"start": _load1()}, "command": report_md.command_line(argv)}
    received: list[int] = []
    previous = _interruptible(received)
    try:
        _run_benchmarks(args, names, rows, report)
    except KeyboardInterrupt:  # the benchmark running was cancelled: its children are stopped
        name = signal.Signals(received[0] if received else signal.SIGINT).name
        report["interrupted"] = name
        _write(args, report, rows)
        print(f"bench: interrupted by {name}; results so far: {args.results}", file=sys.stderr, flush=True)
        return 128 + (received[0] if received else signal.SIGINT)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(format_table(rows + evaluate(rows)), flush=True)
    plotted = plot(rows, args.plot)
    print(f"results: {args.results}" + (f"; plot: {args.plot}" if plotted else ""), flush=True)
    return 1 if report["failed"] else 0


def _run_benchmarks(args: argparse.Namespace, names: list[str], rows: list[Row], report: dict[str, Any]) -> None:
    for name in tqdm(names, desc=f"bench ({args.size})", unit="bench", disable=args.no_progress):
        t0 = time.monotonic()
        try:
            rows += asyncio.run(BENCHMARKS[name](args.size))
        except Exception as exc:  # one broken benchmark must not hide the others' numbers
            report["failed"].append(name)
            traceback.print_exc()
            rows.append(Row(name, "-", "FAILED", {}, "", f"{type(exc).__name__}: {exc}"[:300]))
        report["wall_s"][name] = time.monotonic() - t0
        _write(args, report, rows)  # after each benchmark: a run cut short keeps what it measured


def _write(args: argparse.Namespace, report: dict[str, Any], rows: list[Row]) -> None:
    """The results JSON and the markdown of the benchmarks done so far, with the targets they allow."""
    done = rows + evaluate(rows)
    report.update(elapsed_s=time.time() - report["started"], rows=[r.to_json() for r in done])
    report["loadavg"]["end"] = _load1()
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=1), encoding="utf-8")
    if args.markdown is not None:
        report_md.write(args.markdown, report_md.markdown(report, done))


if __name__ == "__main__":
    raise SystemExit(main())
