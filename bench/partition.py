"""Half-open partitions between one component and Redis, seen by a trainer (needs root).

Each case builds separate hosts on this machine (bench/netns.py: network namespaces on one bridge),
runs Redis, reference-engine workers and the component in their own hosts, steps world-model
sessions from the trainer (this process, or HTTP through the gateway) at a steady pace, cuts the
component off Redis with iptables DROP for ``duration`` seconds (no RST: a dead switch or host),
heals, and steps on. It reports what the trainer saw, how long after the heal the component was
back, and what was lost or doubled; every result is compared with a fault-free run.

    python -m bench.partition --durations 5,20,60 [--cases worker,trainer,gateway,supervisor]

Recovery after the heal, per case: ``worker`` its first heartbeat (its re-registration once the
partition outlived its lease); ``trainer`` its first step answered; ``gateway`` the first step
answered over HTTP; ``supervisor`` its first new connection to Redis. ``redis-paused`` is no
partition: Redis is stopped (SIGSTOP) for ``duration`` and continued, and recovery is the trainer's
first step answered after that. The fault tier
(tests/faults/) runs each case once and asserts the correctness; the figures are in
docs/network-faults.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import Children
from bench.netns import Host, Network, missing_tools
from broker import FleetClient, Session
from broker.redis.aio import resolve
from broker.redis.connect import open_redis, server_time_ms
from broker.redis.embedded import find_redis_server
from broker.redis.keys import CellKeys
from cli import processes
from schemas.messages import StepResult, WorldStep
from workers.engines.base import EngineRequest
from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

ROOT = Path(__file__).resolve().parent.parent
CASES = ("worker", "trainer", "gateway", "supervisor", "redis-paused")
SHAPE = (1, 4, 2, 8, 10)
MODEL = "reference-world"
REDIS_PORT = 6379
GATEWAY_PORT = 8000
API_KEY = "partition-bench-key"
HEARTBEAT_MS = 200
LEASE_MS = 1000
SESSIONS = 4
PACE_S = 0.05  # between one session's steps: a steady load, not a flood
WARMUP_S = 2.0  # stepping before the cut
TAIL_S = 3.0  # stepping after the recovery
RESEND_S = 0.2  # a trainer re-sends a step that answered an error after this
RETRY_BOUND_S = 240.0  # the longest one step is re-sent before it counts as lost
STEP_TIMEOUT_S = 30.0  # each attempt's wait (the client's, and the gateway's 504)
RECOVERY_BOUND_S = 120.0  # the longest the harness waits for a recovery (then: not recovered)
START_BOUND_S = 120.0  # workers import torch: a loaded machine takes a while


@dataclasses.dataclass
class Outcome:
    """One partition, as the closing table reports it."""

    case: str
    duration_s: float
    recovery_s: float | None  # after the heal; None: not back within RECOVERY_BOUND_S
    longest_wait_s: float  # the longest a trainer waited for one step's answer (re-sends included)
    answers: collections.Counter[str]  # error codes the trainer got (each re-sent)
    steps: int
    lost: int  # steps without an ok answer, or not committed
    doubled: int  # commits the workers made beyond one per step committed (their own count)
    mismatched: int  # ok answers that differ from the fault-free run

    @property
    def saw(self) -> str:
        errors = ", ".join(f"{code} x{n}" for code, n in sorted(self.answers.items()))
        return f"longest step {self.longest_wait_s:.1f} s; " + (f"{errors} (re-sent)" if errors else "no error")

    def row(self) -> str:
        recovery = "not back" if self.recovery_s is None else f"{self.recovery_s:.2f} s"
        fault = "Redis stopped (SIGSTOP)" if self.case == "redis-paused" else f"{self.case} <-> Redis"
        return (f"| {fault} | {self.duration_s:g} s | {self.saw} | {recovery} | {self.lost} | "
                f"{self.doubled} |")


HEADER = ("| fault | duration | what the trainer saw | recovery after the heal | steps lost | steps doubled |\n"
          "|---|---:|---|---:|---:|---:|")


# --------------------------------------------------------------------------- the lab


@dataclasses.dataclass
class Lab:
    """Redis in its own host, the processes of one case in theirs, the harness in the root host."""

    net: Network
    redis: Host
    children: Children
    prefix: str
    redis_process: processes.Process

    @property
    def url(self) -> str:
        return f"redis://{self.redis.ip}:{REDIS_PORT}"

    def spawn(self, host: Host, command: list[str]) -> processes.Process:
        return self.children.spawn([*host.prefix(), *command], env={"PYTHONPATH": str(ROOT)})

    def worker(self, host: Host) -> processes.Process:
        return self.spawn(host, processes.worker_command(
            self.url, self.prefix, engine="reference", latent_shape=SHAPE, heartbeat_ms=HEARTBEAT_MS,
            lease_ms=LEASE_MS))

    async def wait(self, check: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + START_BOUND_S
        while time.monotonic() < deadline:
            self.children.check_alive()
            with contextlib.suppress(Exception):
                if await check():
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{what} not ready within {START_BOUND_S}s")

    async def workers(self, count: int) -> None:
        redis = open_redis(self.url)
        try:
            async def ready() -> bool:
                return int(await redis.zcard(CellKeys(self.prefix).workers)) >= count

            await self.wait(ready, f"{count} workers")
        finally:
            await redis.aclose()

    async def commits(self) -> int:
        """The steps the cell's worker processes committed, by their own count (each commit that
        moved a session's committed step; a duplicate is not one). A worker that came back as a new
        incarnation carries its count on, so each process counts once: its highest figure."""
        await asyncio.sleep(2 * HEARTBEAT_MS / 1000)  # the counts travel with the heartbeats
        redis = open_redis(self.url, decode_responses=True)
        try:
            by_process: dict[str, int] = {}
            async for key in redis.scan_iter(match=CellKeys(self.prefix).worker("*")):
                count = await resolve(redis.hget(key, "committed_steps"))
                process = key.rsplit("-", 1)[0]  # w-<host>-<pid>-<random>: one process, any incarnation
                by_process[process] = max(by_process.get(process, 0), int(count or 0))
            return sum(by_process.values())
        finally:
            await redis.aclose()

    async def partition(self, host: Host | str, duration_s: float) -> float:
        """Cut ``host`` off Redis for ``duration_s``; the heal's monotonic time."""
        self.net.cut(host, self.redis)
        await asyncio.sleep(duration_s)
        self.net.heal(host, self.redis)
        return time.monotonic()


@contextlib.contextmanager
def lab(site: int = 0) -> Iterator[Lab]:
    """A fresh network (bench/netns.py's ``site``) with Redis in its own host."""
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"a partition needs {', '.join(missing)}")
    with Network(site) as net, Children() as children:
        redis = net.host("redis")
        server = children.spawn([*redis.prefix(), find_redis_server(), "--bind", redis.ip, "--port", str(REDIS_PORT),
                                 "--save", "", "--appendonly", "no", "--protected-mode", "no"])
        yield Lab(net, redis, children, f"p{uuid.uuid4().hex[:8]}", server)


# --------------------------------------------------------------------------- the trainer


def step_inputs(k: int, i: int) -> dict[str, Any]:
    """Session ``k``'s step ``i``: a world-model step whose latent depends on the session's history."""
    image = np.random.default_rng(k * 1000 + i).integers(0, 256, size=(24, 32, 3), dtype=np.uint8)
    return {"observation": {"prompt": f"episode {k}", "images": {"observation/exterior_image_1_left": image},
                            "state": [0.01 * i] * 8},
            "action": {"joint_positions": [0.1 * ((i + j) % 5) for j in range(7)], "gripper_position": [0.5]}}


@dataclasses.dataclass
class Track:
    """One session's run: an answer per step (the last attempt's), when it came, what came before."""

    latents: list[bytes | None] = dataclasses.field(default_factory=list)
    done_at: list[float] = dataclasses.field(default_factory=list)
    waits: list[float] = dataclasses.field(default_factory=list)
    answers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


Attempt = Callable[[int], Awaitable[tuple[bytes | None, str | None, bool]]]  # latent, error code, duplicate


async def drive(attempt: Attempt, track: Track, stop: asyncio.Event) -> None:
    """Step on, one step at a time, re-sending a step that answered an error, until ``stop``."""
    while not stop.is_set():
        i = len(track.latents)
        started = time.monotonic()
        latent = None
        while time.monotonic() - started < RETRY_BOUND_S:
            latent, error, _ = await attempt(i)
            if error is None:
                break
            track.answers[error] += 1
            await asyncio.sleep(RESEND_S)
        track.latents.append(latent)
        track.done_at.append(time.monotonic())
        track.waits.append(track.done_at[-1] - started)
        if latent is None:
            return  # lost: the run ends for this session
        await asyncio.sleep(PACE_S)


def client_attempt(session: Session, k: int) -> Attempt:
    async def attempt(i: int) -> tuple[bytes | None, str | None, bool]:
        result: StepResult = await session.step(i, timeout=STEP_TIMEOUT_S, **step_inputs(k, i))
        if not result.ok or result.output is None:
            return None, str(result.error.code) if result.error else "no output", False
        return np.asarray(result.output["video_latent"]).tobytes(), None, result.duplicate

    return attempt


def http_attempt(http: httpx.AsyncClient, session_id: str, k: int) -> Attempt:
    async def attempt(i: int) -> tuple[bytes | None, str | None, bool]:
        inputs = step_inputs(k, i)
        images = {name: img.tolist() for name, img in inputs["observation"]["images"].items()}
        body = {"step_id": i, "observation": {**inputs["observation"], "images": images}, "action": inputs["action"]}
        try:
            r = await http.post(f"/v1/realtime/sessions/{session_id}/step", json=body)
            data = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            return None, type(exc).__name__, False
        if r.status_code != 200 or data.get("error"):
            return None, str((data.get("error") or {}).get("code", r.status_code)), False
        latent = base64.b64decode(data["next_observation"]["video_latent"])
        return latent, None, r.headers.get("X-Rollout-Duplicate") == "true"

    return attempt


@dataclasses.dataclass
class Run:
    """Sessions stepping at a steady pace until :meth:`finish`."""

    attempts: list[Attempt]
    tracks: list[Track] = dataclasses.field(default_factory=list)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    def start(self) -> Run:
        self.tracks = [Track() for _ in self.attempts]
        self.tasks = [asyncio.create_task(drive(a, t, self.stop)) for a, t in zip(self.attempts, self.tracks,
                                                                                  strict=True)]
        return self

    def first_answer_after(self, moment: float) -> float | None:
        times = [t for track in self.tracks for t, latent in zip(track.done_at, track.latents, strict=True)
                 if t > moment and latent is not None]
        return min(times) if times else None

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


def fault_free(steps: list[int]) -> list[list[bytes]]:
    """Each session's latents straight through one reference engine, no fleet, no fault."""
    engine = ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE))
    out = []
    for k, n in enumerate(steps):
        rows = []
        for i in range(n):
            step = WorldStep.from_wire(step_inputs(k, i))
            [res] = engine.run_direct(MODEL, [EngineRequest(f"s{k}", MODEL, step, reset=i == 0)])
            assert not isinstance(res, BaseException)
            rows.append(np.asarray(res.output["video_latent"]).tobytes())
        out.append(rows)
    return out


def outcome(case: str, duration_s: float, recovery_s: float | None, run: Run, expected: list[list[bytes]],
            committed: list[int], commits: int) -> Outcome:
    """``committed``: each session's committed step id at the end; ``commits``: the fresh commits
    the workers counted (every session of the cell, a fault-free reference run's included)."""
    answers: collections.Counter[str] = collections.Counter()
    lost = mismatched = 0
    doubled = max(0, commits - sum(last + 1 for last in committed))
    for track, want, last in zip(run.tracks, expected, committed, strict=True):
        answers.update(track.answers)
        sent = len(track.latents)
        lost += sum(latent is None for latent in track.latents) + max(0, sent - 1 - last)
        doubled += max(0, last - (sent - 1))
        mismatched += sum(got is not None and got != exp for got, exp in zip(track.latents, want, strict=True))
    return Outcome(case, duration_s, recovery_s, max((w for t in run.tracks for w in t.waits), default=0.0),
                   answers, sum(len(t.latents) for t in run.tracks), lost, doubled, mismatched)


# --------------------------------------------------------------------------- the cases


async def until(check: Callable[[], Awaitable[bool]], since: float) -> float | None:
    """Seconds from ``since`` until ``check`` holds (polled), None past RECOVERY_BOUND_S."""
    while time.monotonic() - since < RECOVERY_BOUND_S:
        with contextlib.suppress(Exception):
            if await check():
                return time.monotonic() - since
        await asyncio.sleep(0.02)
    return None


Cut = Callable[["Run"], Awaitable[float | None]]  # runs the partition; the recovery after the heal


async def client_case(lab: Lab, case: str, duration_s: float, cut: Cut) -> Outcome:
    """Sessions stepping through a FleetClient in this process while ``cut`` runs the partition."""
    async with FleetClient(lab.url, prefix=lab.prefix, step_timeout=STEP_TIMEOUT_S) as fleet:
        sessions = [await fleet.create_session(model=MODEL, mode="world_model_env") for _ in range(SESSIONS)]
        run = Run([client_attempt(s, k) for k, s in enumerate(sessions)]).start()
        await asyncio.sleep(WARMUP_S)
        recovery = await cut(run)
        await asyncio.sleep(TAIL_S)
        await run.finish()
        committed = [(await s.status()).committed_step_id for s in sessions]
    expected = await asyncio.to_thread(fault_free, [len(t.latents) for t in run.tracks])
    return outcome(case, duration_s, recovery, run, expected, committed, await lab.commits())


async def answered_after(run: Run, healed: float) -> float | None:
    """Seconds from the heal to the first step answered after it."""
    async def answered() -> bool:
        return run.first_answer_after(healed) is not None

    if await until(answered, healed) is None:
        return None
    first = run.first_answer_after(healed)
    return None if first is None else first - healed


async def worker_case(lab: Lab, duration_s: float) -> Outcome:
    """Two workers; one is cut off. Its sessions fail over to the other within the lease; once
    healed it comes back (as a new incarnation when the cut outlived its lease)."""
    cut_host = lab.net.host("w1")
    victim = lab.worker(cut_host)
    lab.worker(lab.net.host("w2"))
    await lab.workers(2)
    redis = open_redis(lab.url)

    async def cut(run: Run) -> float | None:
        lab.net.cut(cut_host, lab.redis)
        await asyncio.sleep(duration_s)
        # Read before the heal, on the clock heartbeats use: any later score is a heartbeat after it.
        healed_ms = await server_time_ms(redis, CellKeys(lab.prefix).workers)
        lab.net.heal(cut_host, lab.redis)
        healed = time.monotonic()

        async def beats() -> bool:
            scores = await redis.zrange(CellKeys(lab.prefix).workers, 0, -1, withscores=True)
            return any(f"-{victim.pid}-" in member.decode() and score >= healed_ms for member, score in scores)

        return await until(beats, healed)

    try:
        return await client_case(lab, "worker", duration_s, cut)
    finally:
        await redis.aclose()


async def trainer_case(lab: Lab, duration_s: float) -> Outcome:
    """The trainer (this process, the root host) is cut off; its steps wait, then go on."""
    lab.worker(lab.net.host("w1"))
    await lab.workers(1)

    async def cut(run: Run) -> float | None:
        return await answered_after(run, await lab.partition(lab.net.root_ip, duration_s))

    return await client_case(lab, "trainer", duration_s, cut)


async def paused_redis_case(lab: Lab, duration_s: float) -> Outcome:
    """Not a partition: Redis itself stopped (SIGSTOP) and continued. Its kernel still answers TCP,
    so no connection is dropped as dead; every call waits, then goes on."""
    lab.worker(lab.net.host("w1"))
    await lab.workers(1)

    async def cut(run: Run) -> float | None:
        lab.redis_process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(duration_s)
        finally:
            lab.redis_process.send_signal(signal.SIGCONT)
        return await answered_after(run, time.monotonic())

    return await client_case(lab, "redis-paused", duration_s, cut)


async def supervisor_case(lab: Lab, duration_s: float) -> Outcome:
    """The supervisor is cut off while the trainer steps; once healed it connects again."""
    sup = lab.net.host("sup")
    lab.worker(lab.net.host("w1"))
    lab.spawn(sup, processes.supervisor_command(lab.url, lab.prefix, lease_ms=LEASE_MS))
    await lab.workers(1)
    redis = open_redis(lab.url, decode_responses=True)

    async def connected_from(ip: str, after_id: int) -> bool:
        clients = await redis.client_list()
        return any(c["addr"].startswith(f"{ip}:") and int(c["id"]) > after_id for c in clients)

    async def cut(run: Run) -> float | None:
        await lab.wait(lambda: connected_from(sup.ip, 0), "the supervisor's connection")
        healed = await lab.partition(sup, duration_s)
        newest = max(int(c["id"]) for c in await redis.client_list())
        return await until(lambda: connected_from(sup.ip, newest), healed)

    try:
        return await client_case(lab, "supervisor", duration_s, cut)
    finally:
        await redis.aclose()


async def gateway_case(lab: Lab, duration_s: float) -> Outcome:
    """Sessions stepping over HTTP through a gateway that is cut off Redis; each step that answers
    an error is re-sent. Compared with the same steps through the same gateway, fault-free, after."""
    gw = lab.net.host("gw")
    lab.worker(lab.net.host("w1"))
    lab.spawn(gw, processes.cli_command("gateway", "--redis-url", lab.url, "--prefix", lab.prefix, "--host", gw.ip,
                                        "--port", str(GATEWAY_PORT), "--api-key", API_KEY, "--model", MODEL,
                                        "--step-timeout", str(STEP_TIMEOUT_S)))
    await lab.workers(1)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=f"http://{gw.ip}:{GATEWAY_PORT}", headers=headers,
                                 timeout=STEP_TIMEOUT_S + 30) as http:
        await lab.wait(lambda: healthy(http), "the gateway")
        sids = [await http_session(http) for _ in range(SESSIONS)]
        run = Run([http_attempt(http, sid, k) for k, sid in enumerate(sids)]).start()
        await asyncio.sleep(WARMUP_S)
        recovery = await answered_after(run, await lab.partition(gw, duration_s))
        await asyncio.sleep(TAIL_S)
        await run.finish()
        committed = [await http_committed(http, sid) for sid in sids]
        expected = [await fault_free_http(http_attempt(http, await http_session(http), k), len(track.latents))
                    for k, track in enumerate(run.tracks)]
    reference_commits = sum(len(rows) for rows in expected)  # the fault-free run's, in the same cell
    return outcome("gateway", duration_s, recovery, run, expected, committed,
                   await lab.commits() - reference_commits)


async def healthy(http: httpx.AsyncClient) -> bool:
    return (await http.get("/health")).status_code == 200


async def http_session(http: httpx.AsyncClient) -> str:
    r = await http.post("/v1/realtime/sessions", json={"model": MODEL, "mode": "world_model_env"})
    r.raise_for_status()
    return str(r.json()["session_id"])


async def http_committed(http: httpx.AsyncClient, session_id: str) -> int:
    r = await http.get(f"/v1/realtime/sessions/{session_id}/status")
    r.raise_for_status()
    return int(r.json()["committed_step_id"])


async def fault_free_http(attempt: Attempt, steps: int) -> list[bytes]:
    """The same steps through the same gateway on a fresh session, with no fault."""
    out = []
    for i in range(steps):
        latent, error, _ = await attempt(i)
        if latent is None:
            raise RuntimeError(f"the fault-free run failed at step {i}: {error}")
        out.append(latent)
    return out


RUNNERS: dict[str, Callable[[Lab, float], Awaitable[Outcome]]] = {
    "worker": worker_case, "trainer": trainer_case, "gateway": gateway_case, "supervisor": supervisor_case,
    "redis-paused": paused_redis_case}


async def run_case(case: str, duration_s: float) -> Outcome:
    """One case in a fresh lab (its own namespaces, Redis and processes)."""
    with lab() as one:
        return await RUNNERS[case](one, duration_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--durations", default="5,20,60", help="partition lengths in seconds, comma-separated")
    parser.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    durations = [float(d) for d in args.durations.split(",")]
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {', '.join(unknown)}; choose from {', '.join(CASES)}")
    print(HEADER, flush=True)
    for case in cases:
        for duration in durations:
            print(asyncio.run(run_case(case, duration)).row(), flush=True)


if __name__ == "__main__":
    main()
