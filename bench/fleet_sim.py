"""A large-fleet simulation: what one step costs Redis (per master, per cell) and the fleet's processes.

    python -m bench.fleet_sim                                   # small: finishes in a few minutes on 2 cores
    python -m bench.fleet_sim --workers 1000 --sessions 10000   # the issue's size (see docs/sizing.md)

Starts a local Redis Cluster (or takes ``--redis-url``), picks cells on distinct masters, starts
``--workers`` null-engine workers spread over ``--worker-procs`` processes (many in-process workers
each, so Redis is what is measured), then measures three windows: idle (workers only: what
heartbeats, blocked reads and reaping cost per worker and second), token steps and world-model
steps whose result is a ``--latent-bytes`` latent. In each window: INFO commandstats / cpu / net
deltas on every master, step counts per cell from the trainers, CPU of the worker and trainer
processes. Figures are per step (and ``*_net``: less the idle window's rate), which do not depend
on the fleet's size: docs/sizing.md turns them into capacities. Output: JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redis.asyncio.connection import parse_url
from redis.exceptions import RedisError

from bench import fleet_sim_report
from bench.common import LATENT_SHAPE, Children, new_prefix, process_cpu_s
from bench.fleet_sim_report import Window
from bench.redis_meter import ClusterMeter, Master, cells_on_masters, cluster_masters, snapshot
from broker.redis.connect import is_cluster_url, parse_cluster_url
from broker.redis.embedded_cluster import running_cluster
from cli import processes
from cli.processes import Process

# Latent steps first: their few sessions stay parked through the token window, while 10,000 parked
# token sessions would add their owners' idle sweeps to the latent window.
KINDS = ("latent", "token")
READY_TIMEOUT_S = 600.0  # 1,000 workers registering on two shared cores take a while


@dataclass(frozen=True)
class SimConfig:
    workers: int = 60
    sessions: int = 600  # token sessions, closed loop: one step in flight each
    latent_sessions: int = 32
    latent_bytes: int = 4 * math.prod(LATENT_SHAPE)  # the DreamZero world latent, float32: 450,560 bytes
    masters: int = 3
    cells_per_master: int = 1
    worker_procs: int = 2
    trainer_procs: int = 2
    token_len: int = 16
    delay_ms: float = 0.0  # the null engine's simulated compute per batch
    idle_s: float = 12.0  # over two heartbeats and two blocked reads of every worker
    warmup_s: float = 3.0
    window_s: float = 8.0
    heartbeat_ms: int = 5000
    lease_ms: int = 30000
    block_ms: int = 5000
    idle_sweep_s: float = 30.0
    # The trainers' check that a waited-for session still exists (FleetClient's session_check_s):
    # one EXISTS per waiting session per period, so a closed loop whose round trip (sessions /
    # steps/s) exceeds it pays for those checks on every step.
    session_check_s: float = 2.0
    kinds: tuple[str, ...] = KINDS
    # Redis I/O threads of each local master (io-threads, with io-threads-do-reads): 1 is Redis's
    # default, the main thread alone; more take socket reads and writes off the main thread.
    io_threads: int = 1
    # Workers hand large results to their trainers directly (--serve-results on 127.0.0.1, a free
    # port each: schemas/results_wire.py); the trainers' clients fetch them when offered, as by default.
    serve_results: bool = False

    def __post_init__(self) -> None:
        for name in ("workers", "masters", "cells_per_master", "worker_procs", "trainer_procs", "token_len",
                     "latent_bytes", "heartbeat_ms", "lease_ms", "block_ms", "io_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sessions < 0 or self.latent_sessions < 0 or self.latent_bytes % 4:
            raise ValueError("sessions must be >= 0 and latent_bytes a multiple of 4 (float32)")
        periods = (self.idle_s, self.warmup_s, self.window_s, self.session_check_s, self.idle_sweep_s)
        if min(periods) <= 0 or self.delay_ms < 0:
            raise ValueError("idle_s, warmup_s, window_s, session_check_s and idle_sweep_s must be positive, "
                             "delay_ms >= 0")
        if self.heartbeat_ms >= self.lease_ms or not set(self.kinds) <= set(KINDS):
            raise ValueError(f"heartbeat_ms must be below lease_ms; kinds are {', '.join(KINDS)}")


def masters_of(url: str) -> list[Master]:
    """The masters behind ``url``: a cluster's from CLUSTER SLOTS, or one node serving every slot."""
    if is_cluster_url(url):
        nodes, _ = parse_cluster_url(url)
        return cluster_masters(*nodes[0])
    parsed = parse_url(url)
    if "host" not in parsed:
        raise ValueError(f"--redis-url must be a redis:// or redis+cluster:// TCP URL, got {url!r}")
    return [Master(str(parsed["host"]), int(parsed.get("port", 6379)), ((0, 16383),))]


# --------------------------------------------------------------------------- children


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class Fleet:
    """The simulation's child processes (``Children`` stops them all, errors too) and their files."""

    def __init__(self, config: SimConfig, url: str, cells: Sequence[str], children: Children, tmp: str) -> None:
        self.config, self.url, self.cells, self.children, self.tmp = config, url, list(cells), children, tmp
        self.prefix = new_prefix("sim")
        self.worker_procs: list[Process] = []
        self._out: dict[int, Path] = {}  # pid -> the file that child reports in

    def _spec(self, role: str, index: int, **fields: Any) -> dict[str, Any]:
        c = self.config
        return {"url": self.url, "prefix": self.prefix, "lease_ms": c.lease_ms, "out": f"{self.tmp}/{role}{index}.json",
                # a child ends on its own well after the parent would have stopped it
                "max_s": READY_TIMEOUT_S + c.idle_s + 2 * (c.warmup_s + c.window_s) + 600.0, **fields}

    def _spawn(self, role: str, spec: dict[str, Any]) -> Process:
        proc = self.children.spawn([sys.executable, "-m", "bench.fleet_sim_procs", role, json.dumps(spec)])
        self._out[proc.pid] = Path(spec["out"])
        return proc

    def start_workers(self) -> None:
        """Spread the workers evenly over the cells, and the cells' workers over the processes."""
        c = self.config
        per_cell = self.per_cell()
        procs = min(c.worker_procs, c.workers)
        plans: list[dict[str, int]] = [{} for _ in range(procs)]
        for cell, count in per_cell.items():
            for plan, share in zip(plans, _shares(count, procs), strict=True):
                if share:
                    plan[cell] = share
        for i, plan in enumerate(plans):
            spec = self._spec("worker", i, cells=plan, latent_floats=c.latent_bytes // 4, delay_ms=c.delay_ms,
                              heartbeat_ms=c.heartbeat_ms, block_ms=c.block_ms, idle_sweep_s=c.idle_sweep_s,
                              serve_results=c.serve_results)
            self.worker_procs.append(self._spawn("worker", spec))
        self.wait_ready(self.worker_procs, "workers")

    def per_cell(self) -> dict[str, int]:
        return dict(zip(self.cells, _shares(self.config.workers, len(self.cells)), strict=True))

    def start_trainers(self, kind: str, sessions: int) -> list[Process]:
        procs = [self._spawn("trainer", self._spec(f"trainer-{kind}-", i, cells=self.cells, kind=kind,
                                                   sessions=share, token_len=self.config.token_len,
                                                   session_check_s=self.config.session_check_s))
                 for i, share in enumerate(_shares(sessions, self.config.trainer_procs))]
        self.wait_ready(procs, f"{kind} trainers")
        return procs

    def out_of(self, proc: Process) -> dict[str, Any]:
        path = self._out[proc.pid]
        return dict(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else {}

    def wait_ready(self, procs: Sequence[Process], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(self.out_of(p).get("ready") for p in procs):
            self.children.check_alive()
            if time.monotonic() > deadline:
                behind = [self.out_of(p) for p in procs if not self.out_of(p).get("ready")]
                raise TimeoutError(f"{what} not ready within {READY_TIMEOUT_S:.0f}s; their progress: {behind}")
            time.sleep(0.2)

    def stop(self, procs: Sequence[Process]) -> list[dict[str, Any]]:
        """SIGTERM, a bounded wait, then their final reports."""
        processes.stop(procs, grace_s=60)
        return [self.out_of(p) for p in procs]


def cpu_s(procs: Sequence[Process]) -> float:
    return sum(process_cpu_s(p.pid) for p in procs)


# --------------------------------------------------------------------------- windows


def measure(kind: str, seconds: float, fleet: Fleet, meter_masters: Sequence[Master],
            trainers: Sequence[Process] = ()) -> Window:
    """Mark the trainers' counters and snapshot Redis and CPU at both ends of ``seconds``."""
    window = Window(kind, seconds, ClusterMeter(meter_masters))
    w0, t0 = cpu_s(fleet.worker_procs), cpu_s(trainers)
    for proc in trainers:
        proc.send_signal(signal.SIGUSR1)
    window.meter.start()
    started = time.monotonic()
    time.sleep(seconds)
    for proc in trainers:
        proc.send_signal(signal.SIGUSR1)
    window.meter.stop()
    window.seconds = time.monotonic() - started
    window.worker_cpu_s, window.trainer_cpu_s = cpu_s(fleet.worker_procs) - w0, cpu_s(trainers) - t0
    fleet.children.check_alive()
    return window


def steps_window(kind: str, sessions: int, fleet: Fleet, masters: Sequence[Master]) -> Window:
    trainers = fleet.start_trainers(kind, sessions)
    time.sleep(fleet.config.warmup_s)
    window = measure(kind, fleet.config.window_s, fleet, masters, trainers)
    reports = fleet.stop(trainers)
    fleet.children.procs = [p for p in fleet.children.procs if p not in trainers]
    window.steps = dict.fromkeys(fleet.cells, 0)
    for report in reports:
        marks = report.get("marks", [])
        if len(marks) < 2:
            raise RuntimeError(f"a {kind} trainer did not report its window: {report}")
        for cell in fleet.cells:
            window.steps[cell] += marks[1][cell] - marks[0][cell]
        window.errors += int(report.get("errors", 0))
        window.first_error = window.first_error or str(report.get("first_error", ""))
    return window


def run(config: SimConfig, redis_url: str | None = None) -> dict[str, Any]:
    """The whole simulation; the report's figures are described in docs/sizing.md."""
    with contextlib.ExitStack() as stack:
        io = ["--io-threads", str(config.io_threads), "--io-threads-do-reads", "yes"] if config.io_threads > 1 else []
        url = redis_url or stack.enter_context(running_cluster(config.masters, 0, io)).url
        masters = masters_of(url)
        placed = cells_on_masters(masters, config.cells_per_master)
        children = stack.enter_context(Children())
        fleet = Fleet(config, url, list(placed), children, stack.enter_context(tempfile.TemporaryDirectory()))
        fleet.start_workers()
        windows = [measure("idle", config.idle_s, fleet, masters)]
        sessions = {"token": config.sessions, "latent": config.latent_sessions}
        windows += [steps_window(kind, sessions[kind], fleet, masters) for kind in config.kinds if sessions[kind]]
        workers = fleet.stop(fleet.worker_procs)
        report = fleet_sim_report.build(asdict(config), url, placed, fleet.per_cell(), windows, workers)
    return report


# --------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__.split("\n\n")[0])
    d = SimConfig()
    add = p.add_argument
    add("--workers", type=int, default=d.workers, help="simulated workers (the issue's size: 1000)")
    add("--sessions", type=int, default=d.sessions, help="token sessions (the issue's size: 10000)")
    add("--latent-sessions", type=int, default=d.latent_sessions, help="world-model sessions, one latent per step")
    add("--latent-bytes", type=int, default=d.latent_bytes, help="bytes of each step's latent (default 450,560)")
    add("--masters", type=int, default=d.masters, help="masters of the local cluster (no replicas)")
    add("--cells-per-master", type=int, default=d.cells_per_master)
    add("--worker-procs", type=int, default=d.worker_procs, help="processes the workers are spread over")
    add("--trainer-procs", type=int, default=d.trainer_procs, help="trainer processes per step kind")
    add("--token-len", type=int, default=d.token_len, help="tokens in and out per token step")
    add("--delay-ms", type=float, default=d.delay_ms, help="the null engine's simulated compute per batch")
    add("--idle-s", type=float, default=d.idle_s)
    add("--warmup-s", type=float, default=d.warmup_s)
    add("--window-s", type=float, default=d.window_s)
    add("--heartbeat-ms", type=int, default=d.heartbeat_ms)
    add("--lease-ms", type=int, default=d.lease_ms)
    add("--block-ms", type=int, default=d.block_ms, help="the workers' XREADGROUP / control read block")
    add("--idle-sweep-s", type=float, default=d.idle_sweep_s, help="how often each worker sweeps idle sessions")
    add("--session-check-s", type=float, default=d.session_check_s,
        help="trainers check a waited-for session exists this often (client default 2 s)")
    add("--kinds", default=",".join(d.kinds), help="comma-separated, run in this order: latent, token")
    add("--io-threads", type=int, default=d.io_threads,
        help="Redis I/O threads of each local master (default 1: the main thread alone)")
    add("--serve-results", action="store_true",
        help="workers hand large results to trainers directly (one hop: schemas/results_wire.py)")
    add("--redis-url", default=None, help="measure this Redis (redis:// or redis+cluster://, no auth) "
                                          "instead of starting a local cluster")
    add("--json", type=Path, default=None, help="write the report here")
    return p


def config_of(args: argparse.Namespace) -> SimConfig:
    names = {f for f in SimConfig.__dataclass_fields__} - {"kinds"}
    values = {name: getattr(args, name) for name in names}
    return SimConfig(kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()), **values)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_of(args)
    except ValueError as exc:
        print(f"fleet_sim: {exc}", file=sys.stderr)
        return 2
    if args.redis_url is not None and config.io_threads > 1:
        print("fleet_sim: --io-threads sets the local masters' threads; a --redis-url Redis keeps its own",
              file=sys.stderr)
        return 2
    if args.redis_url is not None:
        try:  # one INFO per master: reachable, and without a password (the meter sends none)
            for master in masters_of(args.redis_url):
                snapshot(master)
        except (RedisError, OSError, ValueError) as exc:
            print(f"fleet_sim: cannot read the masters of --redis-url {args.redis_url!r}: {exc}", file=sys.stderr)
            return 2
    report = run(config, args.redis_url)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(fleet_sim_report.markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
