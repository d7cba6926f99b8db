"""Soak: a steady load for a long time, sampling what could grow (by hand, 30-60 minutes).

A private Redis, ``--workers`` reference-engine workers, the cell's supervisor, the HTTP gateway
(with one API key) and two load children: a trainer process (``FleetClient``) and an HTTP client
process stepping through the gateway. Every lane of both turns its sessions over (create, step
``--steps`` times, close), world-model and token sessions alike, so whatever a session leaves
behind accumulates and shows. Closed sessions keep their keys for ``--closed-retention-hours``
(0.05 h here, 24 h by default in a fleet), so within a run the closed sessions' keys reach their
steady state.

Every ``--interval`` seconds the parent samples each process's resident memory and open file
descriptors (``/proc/PID/status``, ``/proc/PID/fd``; worker, supervisor, gateway, trainer, HTTP
client, Redis), Redis ``used_memory``, its key count and the fleet's stream lengths (inboxes,
reply streams, dead letters, the stats and control streams) and step-record count (the log
hashes), and the load children's step counters. Each sample is appended to ``samples.jsonl`` as
it is taken (a run stopped early keeps them); at the end it writes ``samples.csv`` and
``soak.json`` (the samples, the load, and each series' growth per hour: a least-squares line
through the second half of the run) under ``--out``, and with ``--plot PNG`` the curves. It asserts nothing: a growth is
read from the table and the plot (docs/soak.md).

    python -m bench.soak --minutes 45 --plot docs/img/soak.png
    python -m bench.soak --minutes 2 --interval 2          # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from redis.asyncio import Redis

from bench.children import free_port
from bench.common import Children, new_prefix, private_redis, start_fleet_workers, wait_for
from broker import FleetClient
from broker.redis.connect import open_redis
from broker.redis.keys import CellKeys
from cli import processes

NAME = "soak"
RESULTS = Path(__file__).resolve().parent / "results"
API_KEY = "soak-key"  # the gateway runs with a key: its per-key open-session sets are exercised too
WORLD, LM = ("reference-world", "world_model_env"), ("reference-lm", "tokens")
COUNTS_EVERY_S = 1.0  # how often a load child rewrites its counters file
READY_TIMEOUT_S = 180.0  # workers (torch import) and the gateway on a loaded 2-core machine
STEP_TIMEOUT_S = 60.0  # one HTTP request of the client child


@dataclass(frozen=True)
class Load:
    """The steady load: what runs and how hard it is driven."""

    minutes: float = 45.0
    interval_s: float = 10.0
    workers: int = 3
    trainer_lanes: int = 8  # concurrent sessions of the trainer child (half world, half tokens)
    http_lanes: int = 2  # concurrent sessions of the HTTP client child (world, through the gateway)
    steps: int = 8  # steps per session before it is closed and a new one is created
    latent_shape: tuple[int, ...] = (1, 16, 2, 16, 20)  # 40 KB: over the blob threshold (32 KB)
    closed_retention_hours: float = 0.05


@dataclass(frozen=True)
class Drive:
    """What one load child does (passed as JSON on its command line)."""

    role: str  # trainer | http
    target: str  # the Redis URL (trainer) or the gateway's URL (http)
    prefix: str
    lanes: int
    steps: int
    counts: str  # the counters file it rewrites

    def command(self) -> list[str]:
        return [sys.executable, "-m", "bench.soak", "--drive", json.dumps(asdict(self))]


@dataclass
class Counts:
    """A load child's running totals."""

    steps: int = 0
    errors: int = 0
    sessions: int = 0
    first_error: str = ""

    def failed(self, what: object) -> None:
        self.errors += 1
        self.first_error = self.first_error or str(what)[:300]


# --------------------------------------------------------------------------- load children


def world_step(lane: int, k: int) -> dict[str, Any]:
    return {"observation": {"prompt": f"lane {lane}: pick the cup", "state": [0.01 * k] * 8},
            "action": {"joint_positions": [0.1 * (lane % 7)] * 7, "gripper_position": [float(k % 2)]}}


def token_step(lane: int, k: int) -> dict[str, Any]:
    return {"token_ids": [(lane * 31 + 7 * k + i) % 200 + 3 for i in range(24)],
            "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": lane}}


async def _fleet_session(fleet: FleetClient, lane: int, steps: int, counts: Counts) -> None:
    """One session of a trainer lane: create, step ``steps`` times (until a failure), close."""
    model, mode = WORLD if lane % 2 == 0 else LM
    make = world_step if mode == WORLD[1] else token_step
    session = await fleet.create_session(model, mode)
    try:
        for k in range(steps):
            result = await session.step(k, **make(lane, k))
            if not result.ok:
                counts.failed(result.error)
                return
            counts.steps += 1
    finally:
        await session.close()
        counts.sessions += 1


async def _http_session(client: httpx.AsyncClient, lane: int, steps: int, counts: Counts) -> None:
    """One session through the gateway: create, step, close (JSON, as an upstream client does)."""
    created = await client.post("/v1/realtime/sessions", json={"model": WORLD[0]})
    created.raise_for_status()
    sid = created.json()["session_id"]
    try:
        for k in range(steps):
            answer = await client.post(f"/v1/realtime/sessions/{sid}/step", json={"step_id": k, **world_step(lane, k)})
            if answer.status_code != 200:
                counts.failed(f"{answer.status_code} {answer.text[:200]}")
                return
            counts.steps += 1
    finally:
        await client.post(f"/v1/realtime/sessions/{sid}/close")
        counts.sessions += 1


SessionFn = Callable[[int], Awaitable[None]]


async def _lanes(drive: Drive, one_session: SessionFn, counts: Counts) -> None:
    """Every lane turns sessions over until the parent stops the child (SIGTERM)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def lane(index: int) -> None:
        while not stop.is_set():
            try:
                await one_session(index)
            except Exception as exc:  # a benchmark counts failures; the load goes on
                counts.failed(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)

    async def report() -> None:
        while not stop.is_set():
            _write_counts(Path(drive.counts), counts)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), COUNTS_EVERY_S)

    tasks = [asyncio.create_task(lane(i)) for i in range(drive.lanes)]
    await report()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _write_counts(Path(drive.counts), counts)


def _write_counts(path: Path, counts: Counts) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(counts)), encoding="utf-8")
    tmp.replace(path)


async def run_drive(drive: Drive) -> None:
    counts = Counts()
    if drive.role == "trainer":
        async with FleetClient(drive.target, prefix=drive.prefix) as fleet:
            await _lanes(drive, lambda lane: _fleet_session(fleet, lane, drive.steps, counts), counts)
        return
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=drive.target, headers=headers, timeout=STEP_TIMEOUT_S) as client:
        await _lanes(drive, lambda lane: _http_session(client, lane, drive.steps, counts), counts)


# --------------------------------------------------------------------------- sampling


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (``VmRSS``), NaN once it is gone."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def open_fds(pid: int) -> float:
    """Open file descriptors of a process, NaN once it is gone."""
    try:
        return float(len(os.listdir(f"/proc/{pid}/fd")))
    except OSError:
        return float("nan")


async def _scan(redis: Redis, pattern: str, kind: str) -> list[str]:
    """The keys matching ``pattern`` of one Redis type (a blob's name starts like its log's)."""
    return [key.decode() async for key in redis.scan_iter(match=pattern, count=1000, _type=kind)]


async def _stream_total(redis: Redis, pattern: str) -> float:
    lengths = [int(await redis.xlen(key)) for key in await _scan(redis, pattern, "stream")]
    return float(sum(lengths))


async def _hash_fields(keys: list[str], redis: Redis) -> float:
    sizes = [int(await redis.hlen(key)) for key in keys]  # type: ignore[misc]
    return float(sum(sizes))


async def redis_sample(redis: Redis, keys: CellKeys) -> dict[str, float]:
    """Redis memory, key count, the fleet's stream lengths and step records (log hash fields)."""
    memory: Any = await redis.info("memory")
    logs = await _scan(redis, keys.log("*"), "hash")
    return {
        "redis.used_memory_mb": int(memory["used_memory"]) / 2**20,
        "redis.keys": float(await redis.dbsize()),
        "redis.inbox_entries": await _stream_total(redis, keys.inbox("*")),
        "redis.reply_entries": await _stream_total(redis, keys.reply("*")),
        "redis.dead_letters": await _stream_total(redis, keys.dead),
        "redis.stats_entries": await _stream_total(redis, keys.stats),
        "redis.control_entries": await _stream_total(redis, keys.control),
        "redis.log_keys": float(len(logs)),
        "redis.log_fields": await _hash_fields(logs, redis),
    }


def process_sample(pids: dict[str, int]) -> dict[str, float]:
    values: dict[str, float] = {}
    for name, pid in pids.items():
        values[f"rss_mb.{name}"] = rss_mb(pid)
        values[f"fds.{name}"] = open_fds(pid)
    return values


def load_sample(count_files: dict[str, Path]) -> dict[str, float]:
    values: dict[str, float] = {}
    for role, path in count_files.items():
        with contextlib.suppress(OSError, ValueError):
            counts = json.loads(path.read_text(encoding="utf-8"))
            for key in ("steps", "errors", "sessions"):
                values[f"load.{role}_{key}"] = float(counts[key])
    return values


# --------------------------------------------------------------------------- results


def growth_per_hour(times_s: Sequence[float], values: Sequence[float]) -> float:
    """The slope of a least-squares line through the second half of the run, per hour (NaN when
    fewer than two finite samples are there)."""
    t = np.asarray(times_s, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    half = t >= t[0] + (t[-1] - t[0]) / 2 if len(t) else np.zeros(0, dtype=bool)
    keep = half & np.isfinite(v)
    if keep.sum() < 2 or np.ptp(t[keep]) == 0:
        return float("nan")
    return float(np.polyfit(t[keep], v[keep], 1)[0] * 3600.0)


@dataclass
class Run:
    """What one soak produced: the load, the samples (seconds since the load started) and what the
    load children reported at the end."""

    load: Load
    samples: list[dict[str, float]] = field(default_factory=list)
    first_errors: dict[str, str] = field(default_factory=dict)

    def series(self) -> list[str]:
        names: dict[str, None] = {}
        for sample in self.samples:
            names.update(dict.fromkeys(sample))
        return [name for name in names if name != "t_s"]

    def column(self, name: str) -> list[float]:
        return [sample.get(name, float("nan")) for sample in self.samples]

    def growth(self) -> dict[str, dict[str, float]]:
        times = self.column("t_s")
        table = {}
        for name in self.series():
            values = self.column(name)
            tail = [v for v in values[len(values) // 2:] if np.isfinite(v)]
            table[name] = {"per_hour": growth_per_hour(times, values),
                           "second_half_mean": float(np.mean(tail)) if tail else float("nan"),
                           "last": values[-1] if values else float("nan")}
        return table


def write_results(run: Run, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "samples.csv", out / "soak.json"
    names = ["t_s", *run.series()]
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        writer.writerows([[sample.get(name, "") for name in names] for sample in run.samples])
    report = {"bench": NAME, "load": asdict(run.load), "growth": run.growth(), "first_errors": run.first_errors,
              "samples": run.samples}
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return csv_path, json_path


def growth_table(run: Run) -> str:
    """Markdown: each series, its second-half mean, its last value and its growth per hour."""
    lines = ["| series | second-half mean | last | growth per hour |", "|---|---:|---:|---:|"]
    for name, row in run.growth().items():
        lines.append(f"| {name} | {row['second_half_mean']:.4g} | {row['last']:.4g} | {row['per_hour']:+.3g} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the fleet under load


async def _gateway_ready(url: str, children: Children) -> None:
    async def healthy() -> bool:
        async with httpx.AsyncClient(timeout=5.0) as client:
            return (await client.get(url + "/health")).status_code == 200

    await wait_for(healthy, children, "the gateway", timeout=READY_TIMEOUT_S)


async def start_fleet(children: Children, redis_url: str, prefix: str, load: Load) -> tuple[dict[str, int], str]:
    """Workers, supervisor and gateway: their pids by name, and the gateway's URL."""
    extra = ["--closed-retention-hours", str(load.closed_retention_hours)]
    workers = await start_fleet_workers(children, redis_url, prefix, count=load.workers, engine="reference",
                                        latent_shape=load.latent_shape, extra=extra)
    supervisor = children.spawn(processes.supervisor_command(redis_url, prefix))
    port = free_port()
    gateway = children.spawn(processes.cli_command(
        "gateway", "--redis-url", redis_url, "--prefix", prefix, "--port", str(port), "--api-key", API_KEY,
        "--model", WORLD[0]))
    await _gateway_ready(f"http://127.0.0.1:{port}", children)
    pids = {f"worker{i}": proc.pid for i, proc in enumerate(workers)}
    return {**pids, "supervisor": supervisor.pid, "gateway": gateway.pid}, f"http://127.0.0.1:{port}"


async def sample_until(run: Run, redis: Redis, keys: CellKeys, pids: dict[str, int], count_files: dict[str, Path],
                       children: Children, journal: Path, progress: bool) -> None:
    """Sample until the run's minutes are over; each sample is also appended to ``journal`` (JSON
    lines), so a run stopped early keeps what it measured."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop = started + run.load.minutes * 60.0
    while True:
        children.check_alive()
        now = loop.time()
        sample = {"t_s": now - started, **process_sample(pids), **await redis_sample(redis, keys),
                  **load_sample(count_files)}
        run.samples.append(sample)
        with open(journal, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(sample) + "\n")
        if progress:
            print(f"soak t={sample['t_s']:.0f}s steps={sample.get('load.trainer_steps', 0):.0f}+"
                  f"{sample.get('load.http_steps', 0):.0f} redis={sample['redis.used_memory_mb']:.1f}MB "
                  f"keys={sample['redis.keys']:.0f}", file=sys.stderr, flush=True)
        if now >= stop:
            return
        await asyncio.sleep(min(run.load.interval_s, max(0.0, stop - loop.time())))


def _stop_load(children: Children, drives: dict[str, processes.Process]) -> None:
    """SIGTERM the load children first: they write their final counters and close their sessions."""
    processes.stop(drives.values(), grace_s=30)
    children.procs = [proc for proc in children.procs if proc not in drives.values()]


async def soak(load: Load, out: Path, progress: bool = True) -> Run:
    run = Run(load)
    prefix = new_prefix("soak")
    out.mkdir(parents=True, exist_ok=True)
    with private_redis() as server, Children() as children:
        pids, gateway_url = await start_fleet(children, server.url, prefix, load)
        count_files = {role: out / f"counts-{role}.json" for role in ("trainer", "http")}
        for path in count_files.values():
            path.unlink(missing_ok=True)  # an earlier run's counters in the same folder
        drives = {
            "trainer": children.spawn(Drive("trainer", server.url, prefix, load.trainer_lanes, load.steps,
                                            str(count_files["trainer"])).command()),
            "http": children.spawn(Drive("http", gateway_url, prefix, load.http_lanes, load.steps,
                                         str(count_files["http"])).command()),
        }
        assert server.process is not None
        pids.update({"trainer": drives["trainer"].pid, "http_client": drives["http"].pid,
                     "redis": server.process.pid})
        redis = open_redis(server.url)
        try:
            journal = out / "samples.jsonl"
            journal.unlink(missing_ok=True)
            await sample_until(run, redis, CellKeys(prefix), pids, count_files, children, journal, progress)
        finally:
            await redis.aclose()
            _stop_load(children, drives)
        for role, path in count_files.items():
            with contextlib.suppress(OSError, ValueError):
                run.first_errors[role] = json.loads(path.read_text(encoding="utf-8"))["first_error"]
    return run


# --------------------------------------------------------------------------- plot


PANELS = (("rss_mb.", "resident memory (MiB)"), ("fds.", "open file descriptors"),
          ("redis.used_memory_mb", "Redis used_memory (MiB)"), ("redis.", "Redis keys and stream entries"))


def plot(run: Run, path: Path) -> None:
    """The curves, one panel per kind of series (matplotlib, the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [t / 60.0 for t in run.column("t_s")]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 3.2 * len(PANELS)), sharex=True)
    taken: set[str] = set()
    for ax, (start, title) in zip(axes, PANELS, strict=True):
        for name in run.series():
            if name.startswith(start) and name not in taken:
                taken.add(name)
                ax.plot(minutes, run.column(name), label=name.split(".", 1)[1])
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Load()
    parser.add_argument("--minutes", type=float, default=defaults.minutes, help="how long the load runs")
    parser.add_argument("--interval", type=float, default=defaults.interval_s, help="seconds between samples")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--trainer-lanes", type=int, default=defaults.trainer_lanes)
    parser.add_argument("--http-lanes", type=int, default=defaults.http_lanes)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="steps per session before it closes")
    parser.add_argument("--closed-retention-hours", type=float, default=defaults.closed_retention_hours)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/soak-TIME)")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    parser.add_argument("--quiet", action="store_true", help="no line per sample on stderr")
    parser.add_argument("--drive", default=None, help=argparse.SUPPRESS)  # a load child (JSON)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.drive is not None:
        asyncio.run(run_drive(Drive(**json.loads(args.drive))))
        return 0
    load = Load(minutes=args.minutes, interval_s=args.interval, workers=args.workers,
                trainer_lanes=args.trainer_lanes, http_lanes=args.http_lanes, steps=args.steps,
                closed_retention_hours=args.closed_retention_hours)
    out = args.out or RESULTS / time.strftime("soak-%Y%m%d-%H%M%S")
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped soak stops its fleet too (Children's exit)
    run = asyncio.run(soak(load, out, progress=not args.quiet))
    csv_path, json_path = write_results(run, out)
    if args.plot is not None:
        plot(run, args.plot)
    print(growth_table(run))
    print(f"\n{len(run.samples)} samples: {csv_path} {json_path}" + (f" {args.plot}" if args.plot else ""))
    for role, error in run.first_errors.items():
        if error:
            print(f"first error of the {role}: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
