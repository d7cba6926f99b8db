"""Weight update time: from announcing a policy version on the control stream to the worker's
registry entry showing it and to the first result produced by it, while token sessions generate
long steps, once letting in-flight steps finish and once aborting them; and what each costs (steps
finished on the old weights after the announcement, generation thrown away by aborting).

Real processes: one reference worker (end-of-sequence off, so every step generates exactly
``max_tokens``), a trainer here driving the sessions closed-loop.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Children, Row, module_main, new_prefix, private_redis, start_fleet_workers
from broker import FleetClient, Session
from broker.ops.weights import update_weights, workers_at_version

SHAPE = (1, 4, 2, 8, 10)
LM_OPTS = json.dumps({"eos_token_id": -1})
HEARTBEAT_MS = 100  # the registry shows a worker's version at its next heartbeat


@dataclass
class Trace:
    """(submitted, answered, policy version) of every step."""

    steps: list[tuple[float, float, int]] = field(default_factory=list)
    stop: bool = False


def save_weights(path: Path) -> None:
    from workers.engines.reference import ReferenceEngine, ReferenceEngineConfig

    ReferenceEngine(ReferenceEngineConfig(latent_shape=SHAPE, seed=1)).save_weights(str(path))


async def _drive(session: Session, max_tokens: int, trace: Trace) -> None:
    i = 0
    while not trace.stop:
        ids = [257, 260, 72, 105, 261] if i == 0 else [72]
        submitted = time.time()
        r = await session.step(i, token_ids=ids, sampling={"max_tokens": max_tokens, "seed": i})
        if not r.ok:
            raise RuntimeError(f"step failed during the update: {r.error}")
        trace.steps.append((submitted, time.time(), r.policy_version))
        i += 1


async def _one(url: str, children: Children, weights: Path, in_flight: str, sessions_n: int,
               max_tokens: int) -> dict[str, float]:
    prefix = new_prefix("wu")
    await start_fleet_workers(children, url, prefix, engine="reference", log_level=None, latent_shape=SHAPE,
                              engine_options={"lm": LM_OPTS}, heartbeat_ms=HEARTBEAT_MS)
    async with FleetClient(url, prefix=prefix) as fleet:
        sessions = [await fleet.create_session(model="reference-lm", mode="tokens") for _ in range(sessions_n)]
        trace = Trace()
        drivers = [asyncio.create_task(_drive(s, max_tokens, trace)) for s in sessions]
        await asyncio.sleep(3.0)
        announced = time.time()
        await update_weights(fleet.redis, fleet.keys, model="reference-lm", version=1, path=str(weights),
                             in_flight=in_flight)
        await workers_at_version(fleet.redis, fleet.keys, model="reference-lm", version=1, timeout=120)
        serving = time.time()
        await asyncio.sleep(3.0)
        trace.stop = True
        await asyncio.gather(*drivers)
    old_after = [s for s in trace.steps if s[2] == 0 and s[1] > announced]
    # A step submitted before the announcement that came back on the new weights ran again (with
    # ``abort``): the time it had spent until then, summed over such steps, is work thrown away.
    rerun = [s for s in trace.steps if s[2] == 1 and s[0] < announced]
    thrown = sum(announced - s[0] for s in rerun) if in_flight == "abort" else 0.0
    step_ms = [(b - a) * 1000 for a, b, v in trace.steps if v == 0 and b < announced]
    first_new = min(b for _, b, v in trace.steps if v == 1)
    return {"announce_to_registry_ms": (serving - announced) * 1000,
            "announce_to_first_new_result_ms": (first_new - announced) * 1000,
            "old_version_steps_after": float(len(old_after)),
            "aborted_steps": float(len(rerun)) if in_flight == "abort" else 0.0,
            "aborted_step_time_ms": thrown * 1000,
            "step_ms_before": sum(step_ms) / max(len(step_ms), 1)}


async def run(size: str) -> list[Row]:
    sessions_n, max_tokens = (2, 200) if size == "smoke" else (8, 600)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, private_redis() as server, Children() as children:
        weights = Path(tmp) / "v1.pt"
        save_weights(weights)
        for in_flight in ("finish", "abort"):
            values = await _one(server.url, children, weights, in_flight, sessions_n, max_tokens)
            rows.append(Row("weight_update", f"{sessions_n} token sessions x {max_tokens} tokens/step",
                            f"in_flight={in_flight}", values, "", "reference engine, one worker"))
    return rows


def main(argv: list[str] | None = None) -> int:
    return module_main("weight_update", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
