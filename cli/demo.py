"""The main job on the embedded default: Redis + worker processes + a trainer loop, then a summary.

The trainer steps every session one step at a time (the next action depends on the last
observation), all sessions concurrently, and checks at the end that Redis holds every commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from broker import FleetClient, Session
from broker.redis.config import CellConfig
from broker.redis.embedded import RedisServer
from cli.errors import redact
from cli.processes import Process, spawn_worker, stop
from schemas.messages import StepResult

MODELS = {"reference": ("reference-world", "reference-lm"), "null": ("null-world", "null-lm")}


@dataclass(frozen=True)
class DemoConfig:
    cell_config: CellConfig = field(default_factory=CellConfig)
    embedded_redis: bool = True  # start a Redis for the run (then cell_config's URL is not used)
    workers: int = 2  # worker processes to start; 0 uses the workers already serving the cell
    sessions: int = 16
    steps: int = 40
    mode: str = "both"
    engine: str = "reference"
    engine_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    # SIGKILL one worker once a third of the steps committed: its sessions must move (the workers
    # reap each other; no supervisor runs) and the run must still end with nothing lost.
    kill_one: bool = False
    metrics_port: int | None = None  # worker i serves Prometheus metrics on metrics_port + i


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    committed: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_messages: dict[str, str] = field(default_factory=dict)  # per error code, what its first failure said

    def add(self, result: StepResult) -> None:
        if result.ok:
            self.committed += 1
            self.latencies_ms.append(result.latency.total_ms)
        else:
            self.failed += 1
            code = result.error.code.value if result.error else "unknown"
            self.errors[code] = self.errors.get(code, 0) + 1
            self.first_messages.setdefault(code, result.error.message if result.error else "")


def _world_inputs(session_index: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(session_index * 100_003 + step)
    return {
        "observation": {
            "prompt": "put the red block in the bowl",
            "images": {"observation/exterior_image_1_left": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
                       "observation/wrist_image_left": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
            "state": rng.uniform(-1, 1, 8).tolist(),
        },
        "action": {"joint_positions": rng.uniform(-1, 1, 7).tolist(), "gripper_position": [float(step % 2)]},
    }


def _token_inputs(session_index: int, step: int) -> dict[str, Any]:
    from schemas.reference_tokenizer import ReferenceTokenizer

    tok = ReferenceTokenizer()
    if step == 0:
        messages = [{"role": "user", "content": f"Problem {session_index}: what is {session_index} + 7?"}]
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    else:
        ids = tok.encode(f"\nobservation {step}: try again\n")
    return {"token_ids": list(ids), "sampling": {"max_tokens": 16, "temperature": 1.0, "seed": session_index}}


async def _drive(session: Session, index: int, steps: int, tally: Tally, bar: tqdm[Any] | None) -> None:
    make = _world_inputs if session.mode.value == "world_model_env" else _token_inputs
    for step in range(steps):
        result = await session.step(step, **make(index, step))
        tally.add(result)
        if bar is not None:
            bar.update(1)
        if not result.ok:
            return


def _modes(config: DemoConfig) -> list[tuple[str, str]]:
    world, lm = MODELS[config.engine]
    if config.mode == "world_model_env":
        return [(world, "world_model_env")]
    if config.mode == "tokens":
        return [(lm, "tokens")]
    return [(world, "world_model_env"), (lm, "tokens")]


async def _kill_one_at_a_third(config: DemoConfig, tally: Tally, procs: list[Process]) -> None:
    """SIGKILL the first worker once a third of the run committed (no drain, no handover)."""
    while tally.committed < config.sessions * config.steps // 3:
        await asyncio.sleep(0.05)
    procs[0].kill()
    print(f"\nkilled worker process {procs[0].pid} (SIGKILL) after {tally.committed} steps", flush=True)


async def _trainer(config: DemoConfig, cell: CellConfig, procs: list[Process]) -> tuple[Tally, int, float]:
    tally = Tally()
    async with FleetClient(config=cell) as fleet:
        kinds = _modes(config)
        sessions = [await fleet.create_session(model=kinds[i % len(kinds)][0], mode=kinds[i % len(kinds)][1])
                    for i in range(config.sessions)]
        bar = tqdm(total=config.sessions * config.steps, desc="steps", unit="step",
                   disable=not config.progress, file=sys.stderr)
        started = time.perf_counter()
        killer = asyncio.create_task(_kill_one_at_a_third(config, tally, procs)) if config.kill_one else None
        await asyncio.gather(*[_drive(s, i, config.steps, tally, bar) for i, s in enumerate(sessions)])
        if killer is not None:
            killer.cancel()
        elapsed = time.perf_counter() - started
        bar.close()
        in_redis = 0
        for s in sessions:
            in_redis += (await s.status()).committed_step_id + 1
            await s.close()
    return tally, in_redis, elapsed


async def _wait_for_workers(cell: CellConfig, count: int, procs: list[Process],
                            timeout: float = 180.0) -> None:
    from broker.ops.status import cell_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker process exited during start-up (see its log above)")
        report = await cell_status(config=cell)
        if sum(1 for w in report.workers if w.fields.get("state") == "active") >= count:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{count} workers did not register within {timeout}s")


def _spawn_workers(config: DemoConfig, cell: CellConfig) -> list[Process]:
    options = config.engine_options
    device = options.get("device")
    def metrics(i: int) -> list[str]:
        return [] if config.metrics_port is None else ["--metrics-port", str(config.metrics_port + i)]

    return [spawn_worker(cell.redis_url, cell.prefix, cell=cell.cell, lease_ms=cell.lease_ms, engine=config.engine,
                         latent_shape=options.get("latent_shape") or None, device=str(device) if device else None,
                         extra=metrics(i))
            for i in range(config.workers)]


def scrape_totals(port: int) -> dict[str, float]:
    """Committed steps and failovers as one worker's /metrics shows them (a 2 s bound)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as response:
        text = response.read().decode()
    totals = {"committed": 0.0, "failovers": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rollout_fleet_steps_total" and sample.labels.get("outcome") == "committed":
                totals["committed"] += sample.value
            elif sample.name == "rollout_fleet_failovers_total":
                totals["failovers"] += sample.value
    return totals


def _print_metrics(config: DemoConfig, procs: list[Process]) -> None:
    assert config.metrics_port is not None
    for i, proc in enumerate(procs):
        if proc.poll() is not None:
            continue
        try:
            totals = scrape_totals(config.metrics_port + i)
        except OSError as exc:
            print(f"metrics of worker {i}: unreachable ({exc})", flush=True)
            continue
        print(f"metrics of worker {i} (:{config.metrics_port + i}): rollout_fleet_steps_total{{outcome=committed}}="
              f"{totals['committed']:.0f} rollout_fleet_failovers_total={totals['failovers']:.0f}", flush=True)


def summarize(tally: Tally, expected: int, in_redis: int, elapsed: float) -> tuple[str, bool]:
    lat = np.array(tally.latencies_ms) if tally.latencies_ms else np.zeros(1)
    lost = expected - in_redis
    line = (f"committed={in_redis} failed={tally.failed} lost={lost} steps/s={tally.committed / elapsed:.1f} "
            f"p50_ms={np.percentile(lat, 50):.2f} p99_ms={np.percentile(lat, 99):.2f}")
    return line, lost == 0 and tally.failed == 0


def run_demo(config: DemoConfig) -> int:
    server = RedisServer().start() if config.embedded_redis else None
    cell = dataclasses.replace(config.cell_config, redis_url=server.url) if server else config.cell_config
    procs: list[Process] = []
    try:
        print(f"rollout-fleet demo: redis {redact(cell.redis_url)}, {config.workers} workers ({config.engine}), "
              f"{config.sessions} sessions x {config.steps} steps, mode {config.mode}", flush=True)
        if config.kill_one and config.workers < 2:
            print("demo: --kill-one needs --workers 2 or more (a survivor to take the sessions)", file=sys.stderr)
            return 2
        procs = _spawn_workers(config, cell)
        if config.metrics_port is not None:
            print("metrics: " + " ".join(f"http://127.0.0.1:{config.metrics_port + i}/metrics"
                                         for i in range(config.workers)), flush=True)
        asyncio.run(_wait_for_workers(cell, max(1, config.workers), procs))
        tally, in_redis, elapsed = asyncio.run(_trainer(config, cell, procs))
        line, ok = summarize(tally, config.sessions * config.steps, in_redis, elapsed)
        if tally.errors:
            print("errors: " + json.dumps(tally.errors), flush=True)
            print("first error of each code: " + json.dumps(tally.first_messages), flush=True)
        if config.metrics_port is not None:
            _print_metrics(config, procs)
        print(line, flush=True)
        return 0 if ok else 1
    finally:
        stop(procs, grace_s=60)
        if server is not None:
            with contextlib.suppress(Exception):
                server.cleanup()
