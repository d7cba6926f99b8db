"""Failover time: SIGKILL a worker under load; time from its lease expiry to the first step the new
owner serves (and to the last of its sessions served), steps/s before, during and after, and the
cost of context rebuild per session (parsed from the new owner's log).

Then, by session length: one session of 10, 100 and 1,000 committed steps of each kind (token on
reference-lm, world on reference-world) alone on a worker that is SIGKILLed; lease expiry -> its
next step served by the new owner. A token session is rebuilt in one prefill, a world session
from its latest snapshot (every 16 steps by default) plus the steps after it, so the figure should
not grow with the length.

Real processes: 2 reference workers, the arq supervisor (1 s reaping cadence), a trainer here.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from bench.common import Children, Row, module_main, new_prefix, private_redis, wait_fleet_workers
from broker import FleetClient, Session
from cli.processes import Process, supervisor_command, worker_command
from schemas.reference_tokenizer import ReferenceTokenizer

HEARTBEAT_MS, LEASE_MS = 250, 2000
_REBUILT = re.compile(r"rebuilt (\S+) \((\d+) steps\) in ([\d.]+) ms with (\d+) engine requests")
LENGTHS = {"smoke": (10,), "full": (10, 100, 1000)}
TOK = ReferenceTokenizer()


@dataclass
class Trace:
    """(wall time, worker id) of every result, per session."""

    results: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    stop: bool = False


def _inputs(session: Session, i: int) -> dict[str, object]:
    if session.mode.value == "tokens":
        ids = TOK.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True)
        return {"token_ids": ids if i == 0 else TOK.encode(f" obs {i}"), "sampling": {"max_tokens": 4, "seed": 1}}
    return {"observation": {"prompt": "pick the cup", "state": [0.01 * i] * 8},
            "action": {"joint_positions": [0.1] * 7, "gripper_position": [0.5]}}


async def _drive(session: Session, start: int, trace: Trace) -> None:
    i = start
    rows = trace.results.setdefault(session.session_id, [])
    while not trace.stop:
        r = await session.step(i, **_inputs(session, i))
        if not r.ok:
            raise RuntimeError(f"step failed during failover: {r.error}")
        rows.append((time.time(), r.worker_id))
        i += 1


def _rate(trace: Trace, t0: float, t1: float) -> float:
    n = sum(1 for rows in trace.results.values() for t, _ in rows if t0 <= t < t1)
    return n / max(t1 - t0, 1e-9)


def _worker(url: str, prefix: str, shape: str) -> list[str]:
    # INFO: the heir's "rebuilt ... (N steps) in T ms" lines are what the rebuild rows parse.
    return worker_command(url, prefix, engine="reference", log_level="INFO",
                          latent_shape=[int(d) for d in shape.split(",")], heartbeat_ms=HEARTBEAT_MS,
                          lease_ms=LEASE_MS)


@dataclass(frozen=True)
class Kill:
    """When the victim died, when its lease ran out (on this machine's clock), and who it was."""

    victim_id: str
    at: float
    lease_expiry: float


async def _kill(fleet: FleetClient, victim: Process, victim_id: str) -> Kill:
    secs, micros = await fleet.redis.time()
    skew = time.time() - (int(secs) + int(micros) / 1e6)  # wall clock minus Redis clock
    victim.kill()
    at = time.time()
    last_beat = await fleet.redis.zscore(fleet.keys.workers, victim_id)
    return Kill(victim_id, at, (float(last_beat or 0) / 1000.0) + LEASE_MS / 1000.0 + skew)


async def _all_moved(sessions: list[Session], trace: Trace, kill: Kill) -> float:
    """Wait until every session has a result from another worker after the kill; the time then."""
    while not all(any(w != kill.victim_id and t > kill.at for t, w in trace.results.get(s.session_id, []))
                  for s in sessions):
        await asyncio.sleep(0.02)
    return time.time()


async def _failover(fleet: FleetClient, sessions: list[Session], victim: Process, history: int,
                    trace: Trace) -> tuple[Kill, float]:
    """Warm every session up, drive them all, kill the owner of the first one mid-load."""
    for s in sessions:
        for i in range(history):
            await s.step(i, **_inputs(s, i))
    drivers = [asyncio.create_task(_drive(s, history, trace)) for s in sessions]
    await asyncio.sleep(2.0)
    kill = await _kill(fleet, victim, sessions[0].owner)
    t_all = await _all_moved(sessions, trace, kill)
    await asyncio.sleep(2.0)
    trace.stop = True
    await asyncio.gather(*drivers)
    return kill, t_all


async def run(size: str) -> list[Row]:
    sessions_n, history = (4, 5) if size == "smoke" else (16, 20)
    shape = "1,4,2,8,10" if size == "smoke" else "1,16,2,44,80"
    prefix = new_prefix("fo")
    trace = Trace()
    with private_redis() as server, Children() as children:
        children.spawn(supervisor_command(server.url, prefix, lease_ms=LEASE_MS, log_level=None))
        victim = children.spawn(_worker(server.url, prefix, shape))
        await wait_fleet_workers(server.url, prefix, 1, children)
        async with FleetClient(server.url, prefix=prefix) as fleet:
            sessions = [await fleet.create_session(model="reference-world" if k % 2 == 0 else "reference-lm",
                                                   mode="world_model_env" if k % 2 == 0 else "tokens")
                        for k in range(sessions_n)]
            heir = children.spawn(_worker(server.url, prefix, shape))
            await wait_fleet_workers(server.url, prefix, 2, children)
            kill, t_all = await _failover(fleet, sessions, victim, history, trace)
        rebuilt = [(int(calls), float(ms)) for _, _, ms, calls in _REBUILT.findall(children.tail(heir, 1_000_000))]
    rows = _rows(trace, kill, t_all, rebuilt, f"{sessions_n} sessions ({history}+ steps each), lease {LEASE_MS} ms",
                 shape)
    for mode in ("tokens", "world_model_env"):
        for length in LENGTHS[size]:
            rows.append(await _by_length(mode, length, shape))
    return rows


def _rows(trace: Trace, kill: Kill, t_all: float, rebuilt: list[tuple[int, float]], case: str,
          shape: str) -> list[Row]:
    firsts = [min(t for t, w in rows if w != kill.victim_id and t > kill.at) for rows in trace.results.values()]
    expiry, t_kill = kill.lease_expiry, kill.at
    calls = sum(n for n, _ in rebuilt)
    per_session = sum(ms for _, ms in rebuilt) / max(len(rebuilt), 1)
    return [
        Row("failover", case, "fleet", {"expiry_to_first_ms": (min(firsts) - expiry) * 1000,
                                        "expiry_to_all_ms": (t_all - expiry) * 1000,
                                        "kill_to_first_ms": (min(firsts) - t_kill) * 1000}, "",
            "supervisor reaps every 1 s"),
        Row("failover", case, "steps/s", {"before": _rate(trace, t_kill - 2.0, t_kill),
                                          "during": _rate(trace, t_kill, t_all),
                                          "after": _rate(trace, t_all, t_all + 2.0)}),
        Row("failover", f"rebuild, latent {shape}", "per session",
            {"ms": per_session, "engine_requests": float(calls), "sessions": float(len(rebuilt))}),
    ]


def _step_inputs(mode: str, i: int) -> dict[str, object]:
    """One token in, one generated (2 context tokens a step: 1,000 steps fit the reference LM's
    4,096); or a world step without images."""
    if mode == "tokens":
        return {"token_ids": [3 + i % 250], "sampling": {"max_tokens": 1, "temperature": 1.0, "seed": i}}
    return {"observation": {"prompt": "pick the cup", "state": [0.01 * (i % 100)] * 8},
            "action": {"joint_positions": [0.1 * (i % 7)] * 7, "gripper_position": [0.5]}}


async def _by_length(mode: str, length: int, shape: str) -> Row:
    """One session of ``length`` steps alone on a worker; SIGKILL it; expiry -> next step served."""
    model = "reference-lm" if mode == "tokens" else "reference-world"
    prefix = new_prefix("fl")
    with private_redis() as server, Children() as children:
        victim = children.spawn(_worker(server.url, prefix, shape))
        await wait_fleet_workers(server.url, prefix, 1, children)
        async with FleetClient(server.url, prefix=prefix) as fleet:
            session = await fleet.create_session(model=model, mode=mode)
            heir = children.spawn(_worker(server.url, prefix, shape))
            await wait_fleet_workers(server.url, prefix, 2, children)
            for i in range(length):
                r = await session.step(i, **_step_inputs(mode, i))
                if not r.ok:
                    raise RuntimeError(f"step {i} failed: {r.error}")
            kill = await _kill(fleet, victim, session.owner)
            r = await session.step(length, **_step_inputs(mode, length))
            served = time.time()
            if not r.ok:
                raise RuntimeError(f"the step after the failover failed: {r.error}")
        found = [(int(n), float(ms), int(calls)) for sid, n, ms, calls in _REBUILT.findall(children.tail(heir, 1 << 20))
                 if sid == session.session_id]
    steps, rebuild_ms, calls = found[-1] if found else (0, float("nan"), 0)
    return Row("failover", f"{model}, {length} steps", "by length",
               {"expiry_to_served_ms": (served - kill.lease_expiry) * 1000, "rebuild_ms": rebuild_ms,
                "engine_requests": float(calls), "rebuilt_steps": float(steps)}, "",
               f"lease {LEASE_MS} ms, workers reap every ~{LEASE_MS // 2} ms")


def main(argv: list[str] | None = None) -> int:
    return module_main("failover", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
