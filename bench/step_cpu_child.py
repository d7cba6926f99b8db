"""One case of bench.step_cpu, measured in a child process against the checkout first on its
``PYTHONPATH``: the current one, or an earlier revision's worktree.

It imports nothing of ``bench/`` (an earlier revision may not have this code) and uses only what
every release has: ``FleetClient(url, prefix=...)``, ``create_session``, ``Session.step`` and the
worker command line. One worker process, null engine, every session closed loop (one step in
flight); prints one JSON line: steps/s and the CPU per step of this process (the trainer), the
worker and Redis inside the timed window.

With ``--callgrind-dir`` the worker runs under valgrind's callgrind (and the parent runs this
process under it too, bench.step_cpu ``--callgrind``): instead of a timed window, every session
runs ``--steps`` counted steps after its warm-up, counting is switched on in both processes for
them alone (``callgrind_control``), and the JSON line names the steps and the two pids whose
profiles the parent reads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

CASES: dict[str, tuple[tuple[int, ...], int]] = {  # latent shape, sessions
    "tiny": ((1, 4), 256),
    "latent": ((1, 16, 2, 44, 80), 64),
}
_TICKS = os.sysconf("SC_CLK_TCK")
_READY_S = 60.0  # the worker's registration: a create refused before it is retried until then
_CALLGRIND_READY_S = 300.0  # the same under valgrind, ~50 times slower
_CALLGRIND_LEASE_MS = 600_000  # a worker under valgrind beats late; its sessions must not fail over
_WARM_STEPS = 3  # per session before the counted steps: first steps load sessions, scripts, code paths


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (fields 14 and 15; the name may hold spaces)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def step_inputs(k: int) -> dict[str, Any]:
    """The throughput benchmark's small world step (bench.common.world_inputs)."""
    return {"observation": {"prompt": "pick the cup", "state": [0.01 * k] * 8},
            "action": {"joint_positions": [0.1] * 7, "gripper_position": [0.5]}}


async def _sessions(fleet: Any, count: int, ready_s: float = _READY_S) -> list[Any]:
    """``count`` sessions on the worker: the first one retried until the worker has registered, then
    the rest together (all together from the start, a create refused before the registration and
    one accepted after it left sessions behind that filled the worker for the retries)."""
    deadline = time.monotonic() + ready_s
    while True:
        try:
            first = await fleet.create_session("null-world", "world_model_env")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    rest = await asyncio.gather(*(fleet.create_session("null-world", "world_model_env") for _ in range(count - 1)))
    return [first, *rest]


async def measure(args: argparse.Namespace) -> dict[str, float]:
    from broker import FleetClient  # the checkout under measurement

    shape, count = CASES[args.case]
    command = [sys.executable, "-m", "cli.main", "--log-level", "WARNING", "worker", "--redis-url", args.redis_url,
               "--prefix", args.prefix, "--engine", "null", "--latent-shape", ",".join(str(d) for d in shape)]
    if args.callgrind_dir:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={args.callgrind_dir}/worker.%p", *command,
                   "--lease-ms", str(_CALLGRIND_LEASE_MS)]
    worker = subprocess.Popen(command)
    pids = {"workers": worker.pid, "redis": args.redis_pid}
    try:
        async with FleetClient(args.redis_url, prefix=args.prefix) as fleet:
            if args.callgrind_dir:
                sessions = await _sessions(fleet, count, _CALLGRIND_READY_S)
                return await _counted(sessions, worker.pid, args.steps)
            sessions = await _sessions(fleet, count)
            return await _window(sessions, pids, args.warmup_s, args.window_s)
    finally:
        worker.terminate()
        try:
            worker.wait(10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)


async def _window(sessions: list[Any], pids: dict[str, int], warmup_s: float, window_s: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    start, stop = loop.time() + warmup_s, loop.time() + warmup_s + window_s
    cpu: dict[str, dict[str, float]] = {}
    counted = 0

    def sample(at: str) -> None:
        cpu[at] = {"client": time.process_time(), **{name: process_cpu_s(pid) for name, pid in pids.items()}}

    loop.call_at(start, sample, "start")
    loop.call_at(stop, sample, "stop")

    async def drive(session: Any) -> None:
        nonlocal counted
        k = 0
        while loop.time() < stop:
            result = await session.step(k, **step_inputs(k))
            if not result.ok:
                raise RuntimeError(f"step {k} failed: {result.error}")
            k += 1
            counted += start <= loop.time() <= stop

    await asyncio.gather(*(drive(s) for s in sessions))
    values = {"steps_s": counted / window_s}
    for name in ("client", "workers", "redis"):
        values[f"cpu_us_{name}"] = 1e6 * (cpu["stop"][name] - cpu["start"][name]) / max(counted, 1)
    values["cpu_us_total"] = sum(values[f"cpu_us_{n}"] for n in ("client", "workers", "redis"))
    return values


def _callgrind_control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


async def _counted(sessions: list[Any], worker_pid: int, steps: int) -> dict[str, float]:
    """``steps`` steps of every session, counted by callgrind in this process and the worker."""
    async def drive(session: Any, first: int, count: int) -> None:
        for k in range(first, first + count):
            result = await session.step(k, **step_inputs(k))
            if not result.ok:
                raise RuntimeError(f"step {k} failed: {result.error}")

    await asyncio.gather(*(drive(s, 0, _WARM_STEPS) for s in sessions))
    pids = (worker_pid, os.getpid())
    for pid in pids:
        _callgrind_control(pid, "--instr=on")
        _callgrind_control(pid, "--zero")
    await asyncio.gather(*(drive(s, _WARM_STEPS, steps) for s in sessions))
    for pid in pids:
        _callgrind_control(pid, "--dump")
        _callgrind_control(pid, "--instr=off")
    return {"steps": float(steps * len(sessions)), "pid_client": float(os.getpid()), "pid_workers": float(worker_pid)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--redis-pid", type=int, required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--callgrind-dir", default="", help="run the worker under callgrind, profiles here")
    parser.add_argument("--steps", type=int, default=8, help="counted steps per session (with --callgrind-dir)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
