"""World-model steps against vLLM-Omni's real rollout serving layer (its ``ServingRLRollout`` and
FastAPI router around the CPU stand-in engine client of bench/world_standin.py), three ways, same
sessions, same inputs, same latents out:

- ``direct``: a client of the rollout API (``POST /v1/realtime/sessions``, ``.../{id}/step``), one
  server session per episode, as a trainer without the fleet calls it;
- ``fleet vllm-omni-http``: the same server behind one fleet worker, and behind one worker per
  episode (no two episodes' steps share a worker's engine batch);
- ``fleet vllm-omni``: one fleet worker running the serving layer's engine client in process.

Every episode steps at once (one step of each in flight); latency is one step's request to answer,
steps/s counts steps over the run's wall time. The fleet runs create their sessions inside the
timed run. Latents that differ between systems are printed and make the command exit 1.

    PYTHONPATH=. ~/.cache/rollout-fleet/engines-venv/bin/python -m bench.real_world --size smoke|full
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from bench.common import Latencies, Row, private_redis
from bench.real_common import checked_main, fleet_of, omni_server
from bench.world_standin import ReferenceWorldClient
from schemas.latent_json import decode_latent_json
from schemas.messages import WorldStep
from workers.engines.base import Engine
from workers.engines.vllm_omni_engine import VLLMOmniEngine, VLLMOmniEngineConfig
from workers.engines.vllm_omni_http import PREFIX, VLLMOmniHTTPConfig, VLLMOmniHTTPEngine, step_body

MODEL = "reference-world"
BENCH = "real_world"
RUN_TIMEOUT_S = 900.0
Inputs = dict[str, Any]  # Session.step keyword arguments: observation, action


@dataclass(frozen=True)
class Size:
    episodes: int
    steps: int
    latent_shape: tuple[int, ...]
    rounds: int


SIZES = {"smoke": Size(episodes=3, steps=3, latent_shape=(1, 4, 2, 8, 10), rounds=1),
         # the DreamZero-sized latent of the rollout API (1.1 MB a step as float32)
         "full": Size(episodes=8, steps=8, latent_shape=(1, 16, 2, 44, 80), rounds=2)}


def step_inputs(round_no: int, episode: int, i: int) -> Inputs:
    """One DROID-style step: two camera images, state, a 7-joint action and an explicit seed."""
    rng = np.random.default_rng([round_no, episode, i])
    images = {name: rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
              for name in ("observation/exterior_image_1_left", "observation/wrist_image_left")}
    return {"observation": {"prompt": "pick the cup", "images": images, "state": [0.02 * i] * 8,
                            "extra": {"seed": 1000 * round_no + 10 * episode + i}},
            "action": {"joint_positions": [float(v) for v in rng.uniform(-1, 1, size=7)],
                       "gripper_position": [0.25 * (i % 3)]}}


@dataclass
class Run:
    latents: list[list[bytes]]  # per episode and step: the latent's raw bytes
    step_ms: list[float]
    wall_s: float

    @property
    def steps(self) -> int:
        return sum(len(e) for e in self.latents)


Episode = Callable[[int, list[float]], Awaitable[list[bytes]]]


async def timed(episodes: int, episode: Episode) -> Run:
    step_ms: list[float] = []
    started = time.perf_counter()
    latents = await asyncio.wait_for(asyncio.gather(*(episode(k, step_ms) for k in range(episodes))),
                                     RUN_TIMEOUT_S)
    return Run(list(latents), step_ms, time.perf_counter() - started)


async def direct_run(url: str, size: Size, round_no: int) -> Run:
    """The rollout API called as a trainer without the fleet would: one server session per episode."""
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=httpx.Limits(max_connections=256)) as client:
        async def call(path: str, body: dict[str, Any]) -> Any:
            response = await client.post(path, json=body)
            response.raise_for_status()
            answer = response.json()
            if answer.get("error"):
                raise RuntimeError(f"{path}: {answer['error']}")
            return answer

        async def episode(k: int, step_ms: list[float]) -> list[bytes]:
            sid = (await call(PREFIX, {"model": MODEL, "mode": "world_model_env"}))["session_id"]
            out = []
            for i in range(size.steps):
                body = step_body(WorldStep.from_wire(step_inputs(round_no, k, i)), i, True, 0)
                started = time.perf_counter()
                answer = await call(f"{PREFIX}/{sid}/step", body)
                step_ms.append((time.perf_counter() - started) * 1000)
                out.append(decode_latent_json(answer["next_observation"]).tobytes())
            await call(f"{PREFIX}/{sid}/close", {})
            return out

        return await timed(size.episodes, episode)


async def fleet_runs(url: str, engines: Sequence[Engine], size: Size) -> tuple[list[Run], dict[str, float]]:
    """Every round through in-process workers, one per engine; the runs and the batch sizes."""
    runs = []
    async with fleet_of(url, f"brw{uuid.uuid4().hex[:6]}", engines) as fleet:
        for round_no in range(size.rounds + 1):
            async def episode(k: int, step_ms: list[float], round_no: int = round_no) -> list[bytes]:
                session = await fleet.client.create_session(model=MODEL, mode="world_model_env")
                out = []
                for i in range(size.steps):
                    started = time.perf_counter()
                    r = await session.step(i, **step_inputs(round_no, k, i))
                    step_ms.append((time.perf_counter() - started) * 1000)
                    if not r.ok or r.output is None:
                        raise RuntimeError(f"episode {k} step {i}: {r.error}")
                    out.append(np.asarray(r.output["video_latent"]).tobytes())
                await session.close()
                return out

            runs.append(await timed(size.episodes, episode))
        return runs, fleet.batch_sizes()


def inproc_engine(size: Size) -> VLLMOmniEngine:
    client = ReferenceWorldClient(MODEL, latent_shape=size.latent_shape, seed=0)
    return VLLMOmniEngine(VLLMOmniEngineConfig(model=MODEL), engine_client=client)


def row(system: str, size: Size, runs: Sequence[Run], batches: dict[str, float] | None = None) -> Row:
    summary = Latencies([ms for run in runs for ms in run.step_ms]).summary()
    values = {"steps_s": sum(r.steps for r in runs) / sum(r.wall_s for r in runs),
              "p50": summary["p50"], "p99": summary["p99"], "steps": float(sum(r.steps for r in runs))}
    values.update(batches or {})
    case = f"{size.episodes} episodes x {size.steps} steps, latent {'x'.join(map(str, size.latent_shape))}"
    return Row(BENCH, case, system, values, "ms")


def mismatches(reference: Sequence[Run], other: Sequence[Run], name: str) -> list[str]:
    return [f"{name}: round {r} episode {k} step {i}: latent differs from the direct path"
            for r, (a, b) in enumerate(zip(reference, other, strict=True))
            for k, (ea, eb) in enumerate(zip(a.latents, b.latents, strict=True))
            for i, (la, lb) in enumerate(zip(ea, eb, strict=True)) if la != lb]


def http_engines(url: str, count: int) -> list[Engine]:
    return [VLLMOmniHTTPEngine(VLLMOmniHTTPConfig(base_url=url, model=MODEL)) for _ in range(count)]


async def measure(size: Size) -> tuple[list[Row], list[str]]:
    """Round 0 of every system warms up and is not counted. The fleet's vllm-omni-http runs twice:
    one worker for every episode, and one worker per episode (no two episodes' steps share a
    worker's engine batch)."""
    with private_redis() as redis:
        with omni_server(MODEL, size.latent_shape) as server:
            direct = [await direct_run(server.url, size, r) for r in range(size.rounds + 1)]
            http_runs, http_batches = await fleet_runs(redis.url, http_engines(server.url, 1), size)
            apart_runs, apart_batches = await fleet_runs(redis.url, http_engines(server.url, size.episodes), size)
        inproc_runs, inproc_batches = await fleet_runs(redis.url, [inproc_engine(size)], size)
    rows = [row("direct rollout API (HTTP)", size, direct[1:]),
            row("fleet vllm-omni-http", size, http_runs[1:], http_batches),
            row(f"fleet vllm-omni-http, {size.episodes} workers", size, apart_runs[1:], apart_batches),
            row("fleet vllm-omni (in process)", size, inproc_runs[1:], inproc_batches)]
    ratio = rows[1].values["steps_s"] / rows[0].values["steps_s"]
    rows.append(Row(BENCH, rows[0].case, "fleet vllm-omni-http / direct",
                    {"throughput_ratio": ratio, "overhead_pct": 100.0 * (1.0 - ratio)}))
    bad = (mismatches(direct, http_runs, "fleet vllm-omni-http")
           + mismatches(direct, apart_runs, "fleet vllm-omni-http apart")
           + mismatches(direct, inproc_runs, "fleet vllm-omni"))
    return rows, bad


def main(argv: list[str] | None = None) -> int:
    return checked_main(argv, prog="python -m bench.real_world", sizes=SIZES, measure=measure, what="latents",
                        unit="steps", same="every step of every system equals the direct path bitwise")


if __name__ == "__main__":
    raise SystemExit(main())
