"""Shared pieces of the benchmarks: result rows, percentiles, private Redis, child processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from broker.redis.connect import open_redis
from broker.redis.embedded import RedisServer
from broker.redis.keys import CellKeys
from cli import processes

SIZES = ("smoke", "full")
# glibc malloc: keep freed large blocks instead of returning them to the kernel (munmap / trim);
# in a VM every fresh page of a 450 KB buffer is a costly page fault (see docs/benchmarks.md).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers from <malloc.h>
REPO = Path(__file__).resolve().parent.parent  # the checkout the benchmarks run from
LATENT_SHAPE = (1, 16, 2, 44, 80)  # the DreamZero-sized world latent of the rollout API
TINY_SHAPE = (1, 4)  # the null engine's default: a "tiny result"


@dataclass
class Row:
    """One measured line: ``values`` holds the numbers (p50/p99/max, steps_s, ratio, ...)."""

    bench: str
    case: str
    system: str
    values: dict[str, float]
    unit: str = ""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Latencies:
    """Round-trip samples of one (case, system), in milliseconds."""

    samples_ms: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"[:200]

    def summary(self) -> dict[str, float]:
        arr = np.asarray(self.samples_ms or [float("nan")], dtype=np.float64)
        return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)),
                "max": float(arr.max()), "n": float(len(self.samples_ms)), "errors": float(self.errors)}


def new_prefix(tag: str) -> str:
    return f"b{tag}{uuid.uuid4().hex[:6]}"


def world_inputs(step: int) -> dict[str, Any]:
    """One small world-model step input, the same for every system under test."""
    return {
        "observation": {"prompt": "pick the cup", "state": [0.01 * step] * 8},
        "action": {"joint_positions": [0.1] * 7, "gripper_position": [0.5]},
    }


StepFn = Callable[[Any, int], Awaitable[Any]]
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (Linux /proc), 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuMeter:
    """CPU seconds spent by this process ("client") and named others between start and stop."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self.used_s: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        return {"client": time.process_time(),
                **{name: sum(process_cpu_s(pid) for pid in pids) for name, pids in self.pids.items()}}

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> None:
        self.used_s = {name: now - self._start.get(name, now) for name, now in self._sample().items()}

    def per_step_us(self, steps: int) -> dict[str, float]:
        return {f"cpu_us_{name}": 1e6 * used / steps for name, used in self.used_s.items()} if steps else {}


async def closed_loop(handles: Sequence[Any], total: int, start: int, step: StepFn) -> Latencies:
    """Each handle steps ``total / len(handles)`` times, one step in flight at a time."""
    lat = Latencies()
    per = max(1, total // len(handles))

    async def drive(handle: Any) -> None:
        for k in range(start, start + per):
            t0 = time.perf_counter()
            try:
                await step(handle, k)
            except Exception as exc:
                lat.failed(exc)
                continue
            lat.samples_ms.append((time.perf_counter() - t0) * 1000.0)

    await asyncio.gather(*(drive(h) for h in handles))
    return lat


async def timed_window(bench: str, handles: Sequence[Any], step: StepFn, warmup_s: float,
                       window_s: float, meter: CpuMeter | None = None) -> Row:
    """Every handle steps closed loop (one step in flight); steps/s finished inside the window,
    and with a meter the CPU each process spent per step in it."""
    lat = Latencies()
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    stop = start + window_s
    if meter is not None:
        loop.call_at(start, meter.start)
        loop.call_at(stop, meter.stop)

    async def drive(handle: Any) -> None:
        k = 0
        while loop.time() < stop:
            try:
                await step(handle, k)
            except Exception as exc:
                lat.failed(exc)
                await asyncio.sleep(0.01)  # a failing system must not spin the loop
                continue
            k += 1
            if start <= loop.time() <= stop:
                lat.samples_ms.append(0.0)  # only the count matters here

    await asyncio.gather(*(drive(h) for h in handles))
    values = {"steps_s": len(lat.samples_ms) / window_s, "errors": float(lat.errors)}
    if meter is not None:
        values.update(meter.per_step_us(len(lat.samples_ms)))
    return Row(bench, f"{len(handles)} sessions", "", values, "", lat.first_error)


# --------------------------------------------------------------------------- processes


class Children:
    """Child processes that are always terminated (then killed) when the block ends, errors too."""

    def __init__(self) -> None:
        self.procs: list[processes.Process] = []
        self._logs = contextlib.ExitStack()
        self._log_of: dict[int, IO[bytes]] = {}

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def spawn(self, args: Sequence[str], env: dict[str, str] | None = None) -> processes.Process:
        # stderr goes to a temp file: a pipe nobody reads could fill up and stall the child.
        fd, path = tempfile.mkstemp(prefix="bench-child-")
        os.unlink(path)  # an anonymous file: gone with its descriptor, which stop_all closes
        log = self._logs.enter_context(os.fdopen(fd, "w+b"))
        proc = processes.spawn(args, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self._log_of[proc.pid] = log
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited {proc.returncode}: {self.tail(proc)}")

    def tail(self, proc: processes.Process, size: int = 2000) -> str:
        """The end of a child's stderr, for error messages."""
        log = self._log_of.get(proc.pid)
        if log is None:
            return ""
        log.seek(0)
        return log.read()[-size:].decode("utf-8", "replace")

    def stop_all(self) -> None:
        processes.stop(self.procs, grace_s=15)
        self.procs.clear()
        self._log_of.clear()
        self._logs.close()


@contextlib.contextmanager
def checkout_of(revision: str) -> Iterator[Path]:
    """A temporary git worktree of ``revision`` beside this checkout (removed after), for the
    benchmarks that measure an earlier revision in the same run (bench.step_cpu,
    bench.placement_scale)."""
    with tempfile.TemporaryDirectory(prefix="bench-rev-") as parent:
        path = Path(parent) / "checkout"
        added = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path),
                                revision], capture_output=True, text=True, timeout=120)
        if added.returncode != 0:  # not a git checkout, or no such revision
            raise SystemExit(f"cannot check out {revision!r} beside {REPO}: {added.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                           check=False, timeout=120)


@contextlib.contextmanager
def private_redis(wrapper: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A fresh redis-server on a free port (never the system one), no persistence; ``wrapper``:
    a command it runs under (valgrind), given time to start."""
    server = RedisServer(appendfsync="no", wrapper=list(wrapper)).start(timeout=60.0 if wrapper else 10.0)
    try:
        yield server
    finally:
        server.cleanup()


async def wait_for(check: Callable[[], Awaitable[bool]], children: Children, what: str,
                   timeout: float = 60.0) -> None:
    """Poll ``check`` until true; fail fast with the child's stderr if a child died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children.check_alive()
        with contextlib.suppress(Exception):
            if await check():
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{what} not ready within {timeout}s")


async def wait_fleet_workers(url: str, prefix: str, count: int, children: Children) -> None:
    redis = open_redis(url)
    try:
        key = CellKeys(prefix).workers

        async def ready() -> bool:
            return int(await redis.zcard(key)) >= count

        await wait_for(ready, children, f"{count} fleet workers")
    finally:
        await redis.aclose()


async def start_fleet_workers(children: Children, url: str, prefix: str, *, count: int = 1,
                              env: dict[str, str] | None = None, **options: Any) -> list[processes.Process]:
    """Start ``count`` fleet workers in an empty cell (``options``: ``worker_command``'s) and wait
    until all of them have registered."""
    procs = [children.spawn(processes.worker_command(url, prefix, **options), env=env) for _ in range(count)]
    await wait_fleet_workers(url, prefix, count, children)
    return procs


def tune_malloc() -> bool:
    """Apply MALLOC_ENV to this process (mallopt) and, through the environment, to every child."""
    os.environ.update(MALLOC_ENV)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
                    and libc.mallopt(_M_TRIM_THRESHOLD, int(MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"])))
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


# --------------------------------------------------------------------------- entry points


def format_table(rows: Sequence[Row]) -> str:
    """One plain-text table: bench | case | system | values."""
    head = ("bench", "case", "system", "values")
    lines = [(r.bench, r.case, r.system, _values(r)) for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    return "\n".join(out)


def format_markdown(rows: Sequence[Row]) -> str:
    """The same table as GitHub markdown (for docs/benchmarks.md)."""
    out = ["| bench | case | system | values |", "|---|---|---|---|"]
    out += [f"| {r.bench} | {r.case} | {r.system} | {_values(r).replace('|', '/')} |" for r in rows]
    return "\n".join(out)


def _values(row: Row) -> str:
    parts = []
    for key, value in row.values.items():
        if key in ("n", "errors", "sessions", "workers", "trainers", "window") or key.startswith("cpu_us") \
                or float(value).is_integer():
            parts.append(f"{key}={value:.0f}")
        else:
            parts.append(f"{key}={value:.3g}" if abs(value) >= 100 else f"{key}={value:.3f}")
    text = " ".join(parts) + (f" {row.unit}" if row.unit else "")
    return text + (f"  ({row.note})" if row.note else "")


BenchFn = Callable[[str], Coroutine[Any, Any, list[Row]]]  # a benchmark: size name -> rows


def module_main(name: str, run: BenchFn, argv: Sequence[str] | None = None) -> int:
    """``python -m bench.<name> --size smoke|full``: run one benchmark and print its table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}")
    parser.add_argument("--size", choices=SIZES, default="smoke")
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args.size))
    print(format_table(rows))
    return 0


def checkouts(stack: contextlib.ExitStack, baseline: str | None) -> dict[str, Path]:
    """This checkout, and a worktree of ``baseline`` (removed when ``stack`` closes), by label."""
    roots = {"this checkout": REPO}
    if baseline is not None:
        roots[baseline] = stack.enter_context(checkout_of(baseline))
    return roots


def run_child(root: Path, command: list[str], *, timeout: float, what: str) -> dict[str, float]:
    """A child process that imports the fleet from ``root`` (its ``PYTHONPATH``) and prints its
    figures as one JSON line, last; a failed child raises with the end of its stderr."""
    done = subprocess.run(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} at {root} failed ({done.returncode}): {done.stderr[-2000:]}")
    values: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return values


def revision_rows(bench: str, case: str, runs: dict[str, list[dict[str, float]]],
                  ratios: dict[str, str]) -> list[Row]:
    """One case measured at this checkout and at a revision (``runs``: label -> the alternated
    rounds' values): each label's medians, then, for two labels, the first over the second of each
    value ``ratios`` names (row key -> value key)."""
    rows, medians = [], {}
    for label, values in runs.items():
        medians[label] = {key: statistics.median(v[key] for v in values) for key in values[0]}
        rows.append(Row(bench, case, f"fleet @ {label}", medians[label], "",
                        f"median of {len(values)} alternated round(s)"))
    if len(medians) == 2:
        now, then = medians.values()
        rows.append(Row(bench, case, " / ".join(medians), {name: now[key] / then[key] for name, key in ratios.items()},
                        "x"))
    return rows


def revision_main(name: str, doc: str | None, run: Callable[[str, str | None], Sequence[Row]],
                  argv: Sequence[str] | None = None) -> int:
    """``python -m bench.<name> --size smoke|full [--baseline REV]``: a benchmark that measures this
    checkout beside a worktree of ``REV`` (``run(size, baseline)``), printed as one table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="smoke")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to measure beside this checkout")
    args = parser.parse_args(argv)
    print(format_table(run(args.size, args.baseline)))
    return 0


class NullWorldSteps:
    """The anchors' server-side work for one world step: a NullEngine call, one engine per latent
    shape (what a fleet worker with ``--engine null`` does for the same step)."""

    def __init__(self) -> None:
        self._engines: dict[tuple[int, ...], Any] = {}

    async def __call__(self, session_id: str, step_id: int, inputs: dict[str, Any],
                       latent_shape: Sequence[int]) -> dict[str, Any]:
        from schemas.messages import Mode, parse_step_input
        from workers.engines.base import EngineRequest
        from workers.engines.null import NullEngine, NullEngineConfig

        shape = tuple(latent_shape)
        engine = self._engines.get(shape)
        if engine is None:
            engine = self._engines[shape] = NullEngine(NullEngineConfig(latent_shape=shape))
        request = EngineRequest(session_key=session_id, model="null-world",
                                step=parse_step_input(Mode.WORLD_MODEL_ENV, inputs), reset=step_id == 0)
        out = (await engine.run_batch("null-world", [request]))[0]
        if isinstance(out, BaseException):
            raise out
        return dict(out.output)


class Callgrind:
    """Instruction counts of processes run under valgrind's callgrind, counted from :meth:`on`: the
    same count for the same work on any VM, however busy (a timed run on these VMs swings by up to
    2x), so a change of a few percent shows. ``functions``: inclusive counts to read besides the
    total, by name (name -> the C function whose inclusive count it is)."""

    TOOLS = ("valgrind", "callgrind_control", "callgrind_annotate")
    _LINE = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+(?:\S*:)?([A-Za-z_]\w*)\b")

    def __init__(self, directory: str, functions: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.functions = dict(functions or {})

    @classmethod
    def missing(cls) -> str | None:
        """Why callgrind cannot run here (a tool not on the PATH), or None."""
        absent = [tool for tool in cls.TOOLS if shutil.which(tool) is None]
        return f"--callgrind needs valgrind ({', '.join(cls.TOOLS)}) on the PATH; missing: {', '.join(absent)}" \
            if absent else None

    def wrapper(self, name: str = "callgrind") -> list[str]:
        """The command prefix that runs a process under callgrind, counting nothing until :meth:`on`;
        its profiles are ``<directory>/<name>.<pid>.<n>``."""
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={self.directory}/{name}.%p"]

    @staticmethod
    def control(pid: int, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)

    def on(self, pid: int) -> None:
        """Count from now on."""
        self.control(pid, "--instr=on")
        self.control(pid, "--zero")

    def counts(self, pid: int, name: str = "callgrind") -> dict[str, int]:
        """Instructions since :meth:`on`: ``total`` and each of ``functions`` (inclusive)."""
        self.control(pid, "--dump")
        return self.read(self.last_dump(pid, name))

    def last_dump(self, pid: int, name: str = "callgrind") -> Path:
        dumps = sorted(self.directory.glob(f"{name}.{pid}.*"), key=lambda p: int(p.suffix[1:]))
        if not dumps:
            raise RuntimeError(f"callgrind wrote no profile for pid {pid} in {self.directory}")
        return dumps[-1]

    def read(self, dump: Path) -> dict[str, int]:
        """``total`` and each of ``functions`` of one profile."""
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                              check=True, capture_output=True, text=True, timeout=300).stdout
        counts = {"total": 0, **dict.fromkeys(self.functions, 0)}
        names = {function: name for name, function in self.functions.items()}
        for line in text.splitlines():
            if "PROGRAM TOTALS" in line:
                counts["total"] = int(line.split()[0].replace(",", ""))
                continue
            match = self._LINE.match(line)
            if match and match.group(2) in names:
                name = names[match.group(2)]
                counts[name] = max(counts[name], int(match.group(1).replace(",", "")))
        return counts
