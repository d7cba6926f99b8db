"""The reference engines on a device (a GPU by default): the checks a GPU host must pass, and the
step latency it gives. scripts/gpu_check.sh runs it after checking for the GPU and the engines.

1. Batch invariance: a session's results (world latents; LM tokens and log probs) are bitwise the
   same whether its steps run batched alone or beside other sessions (the engines' promise, see
   workers/engines/torch_ops.py), world model and language model.
2. Fleet equals direct: the same steps through a real fleet worker process (``rollout-fleet worker
   --engine reference --device D``, a private Redis, every session stepping at once) equal the
   engine called directly, bitwise.
3. Latency: one world step batched alone and beside the others (engine only), and a step's round
   trip through the fleet, p50/p99.

Every phase has a time bound (``--budget-s`` in all); the first failed check ends the run with exit
1, a device that is not there with exit 2, each with a line saying why. ``--device cpu`` runs the
same checks on the CPU (the project's tests do).

    PYTHONPATH=. python -m bench.gpu_check [--device cuda] [--sessions 8] [--steps 6] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.common import Children, Latencies, new_prefix, private_redis, start_fleet_workers
from broker import FleetClient
from schemas.messages import TokenStep, WorldStep
from schemas.reference_tokenizer import ReferenceTokenizer
from workers.engines.base import EngineOutput, EngineRequest
from workers.engines.reference import LM_MODEL, WORLD_MODEL, ReferenceEngine, ReferenceEngineConfig

EXIT_FAILED, EXIT_NO_DEVICE = 1, 2
TOK = ReferenceTokenizer()


class CheckFailed(Exception):
    """A check found results that differ (or an engine that failed)."""


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(f"gpu_check: {text}", flush=True)


def device_problem(device: str) -> str | None:
    """Why ``device`` cannot run the reference engines here, or None."""
    try:
        import torch
    except ImportError:
        return f"torch is not installed for {sys.executable}: install the engines (scripts/setup_engines_env.sh)"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False for {sys.executable} (torch {torch.__version__})"
    return None


# --------------------------------------------------------------------------- inputs


def world_inputs(k: int, i: int) -> dict[str, Any]:
    rng = np.random.default_rng([k, i])
    return {"observation": {"prompt": f"task {k % 3}",
                            "images": {"observation/exterior_image_1_left": rng.integers(0, 256, (24, 32, 3),
                                                                                        dtype=np.uint8)},
                            "state": [0.01 * i] * 8, "extra": {"seed": 100 * k + i}},
            "action": {"joint_positions": [float(v) for v in rng.uniform(-1, 1, 7)], "gripper_position": [0.5]}}


def token_inputs(k: int, turn: int) -> dict[str, Any]:
    """Prompts of different lengths (so a batch pads), then short observation turns; seeded sampling."""
    text = f"what is {k} + {'1' * (k % 4 + 1)}?" if turn == 0 else f"\nturn {turn}: try again {k}\n"
    ids = TOK.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True) \
        if turn == 0 else TOK.encode(text)
    return {"token_ids": ids, "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 10 * k + turn}}


def request(model: str, key: str, inputs: dict[str, Any], reset: bool) -> EngineRequest:
    step = WorldStep.from_wire(inputs) if model == WORLD_MODEL else TokenStep.from_wire(inputs)
    return EngineRequest(key, model, step, reset=reset)


def fingerprint(model: str, out: Any) -> bytes:
    """The bits of one result that must match: the latent, or token ids + log probs."""
    if not isinstance(out, EngineOutput):
        raise CheckFailed(f"{model}: the engine failed: {out!r}")
    return fingerprint_of(model, out.output)


def fingerprint_of(model: str, output: Any) -> bytes:
    if model == WORLD_MODEL:
        return np.ascontiguousarray(output["video_latent"]).tobytes()
    return np.asarray(output["token_ids"], np.int64).tobytes() + np.asarray(output["logprobs"], np.float64).tobytes()


INPUTS: dict[str, Callable[[int, int], dict[str, Any]]] = {WORLD_MODEL: world_inputs, LM_MODEL: token_inputs}


# --------------------------------------------------------------------------- checks


def engine(device: str, shape: tuple[int, ...]) -> ReferenceEngine:
    return ReferenceEngine(ReferenceEngineConfig(device=device, latent_shape=shape))


def direct_alone(device: str, shape: tuple[int, ...], model: str, sessions: int, steps: int,
                 lat: Latencies | None = None) -> list[list[bytes]]:
    """Every session's steps, each session in a batch of its own, on a fresh engine."""
    eng = engine(device, shape)
    out = []
    for k in range(sessions):
        row = []
        for i in range(steps):
            started = time.perf_counter()
            [result] = eng.run_direct(model, [request(model, f"s{k}", INPUTS[model](k, i), i == 0)])
            if lat is not None:
                lat.samples_ms.append((time.perf_counter() - started) * 1000)
            row.append(fingerprint(model, result))
        out.append(row)
    return out


def direct_together(device: str, shape: tuple[int, ...], model: str, sessions: int, steps: int,
                    lat: Latencies) -> list[list[bytes]]:
    """The same steps with every session in one batch per step, on a fresh engine."""
    eng = engine(device, shape)
    out: list[list[bytes]] = [[] for _ in range(sessions)]
    for i in range(steps):
        batch = [request(model, f"s{k}", INPUTS[model](k, i), i == 0) for k in range(sessions)]
        started = time.perf_counter()
        results = eng.run_direct(model, batch)
        lat.samples_ms.append((time.perf_counter() - started) * 1000)
        for k, result in enumerate(results):
            out[k].append(fingerprint(model, result))
    return out


def compare(what: str, expected: list[list[bytes]], got: list[list[bytes]]) -> None:
    for k, (a, b) in enumerate(zip(expected, got, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                raise CheckFailed(f"{what}: session {k} step {i} differs")


def batch_invariance(args: argparse.Namespace, report: Report) -> dict[str, list[list[bytes]]]:
    """Both models alone vs together; returns the alone results (the fleet check's reference)."""
    alone: dict[str, list[list[bytes]]] = {}
    for model in (WORLD_MODEL, LM_MODEL):
        one, many = Latencies(), Latencies()
        alone[model] = direct_alone(args.device, args.shape, model, args.sessions, args.steps, one)
        together = direct_together(args.device, args.shape, model, args.sessions, args.steps, many)
        compare(f"batch invariance ({model}, alone vs batch of {args.sessions})", alone[model], together)
        report.say(f"batch invariance {model}: ok ({args.sessions} sessions x {args.steps} steps, bitwise)")
        report.say(f"engine step {model}: batch of 1 p50={one.summary()['p50']:.2f} ms "
                   f"p99={one.summary()['p99']:.2f} ms; batch of {args.sessions} "
                   f"p50={many.summary()['p50']:.2f} ms p99={many.summary()['p99']:.2f} ms")
    return alone


async def through_fleet(args: argparse.Namespace, model: str, fleet: FleetClient, lat: Latencies) -> list[list[bytes]]:
    mode = "world_model_env" if model == WORLD_MODEL else "tokens"
    sessions = [await fleet.create_session(model=model, mode=mode) for _ in range(args.sessions)]

    async def run(k: int, session: Any) -> list[bytes]:
        out = []
        for i in range(args.steps):
            started = time.perf_counter()
            r = await session.step(i, **INPUTS[model](k, i))
            lat.samples_ms.append((time.perf_counter() - started) * 1000)
            if not r.ok:
                raise CheckFailed(f"fleet {model}: session {k} step {i}: {r.error}")
            out.append(fingerprint_of(model, r.output))
        return out

    return list(await asyncio.gather(*(run(k, s) for k, s in enumerate(sessions))))


async def fleet_equals_direct(args: argparse.Namespace, alone: dict[str, list[list[bytes]]], report: Report) -> None:
    with private_redis() as redis, Children() as children:
        prefix = new_prefix("gpu")
        await start_fleet_workers(children, redis.url, prefix, engine="reference", device=args.device,
                                  latent_shape=args.shape, env={**os.environ})
        async with FleetClient(redis.url, prefix=prefix, step_timeout=args.step_timeout_s) as fleet:
            for model in (WORLD_MODEL, LM_MODEL):
                lat = Latencies()
                got = await through_fleet(args, model, fleet, lat)
                compare(f"fleet vs direct ({model})", alone[model], got)
                s = lat.summary()
                report.say(f"fleet equals direct {model}: ok; round trip p50={s['p50']:.2f} ms p99={s['p99']:.2f} ms "
                           f"({args.sessions} sessions at once)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--latent-shape", default="1,16,2,44,80", help="the world latent, comma separated")
    p.add_argument("--budget-s", type=float, default=480.0, help="all checks together must end within this")
    p.add_argument("--step-timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    args.shape = tuple(int(d) for d in args.latent_shape.split(","))
    if args.sessions < 2 or args.steps < 1:
        p.error("--sessions must be >= 2 (a batch beside others) and --steps >= 1")
    return args


async def checks(args: argparse.Namespace, report: Report) -> None:
    alone = await asyncio.to_thread(batch_invariance, args, report)
    await fleet_equals_direct(args, alone, report)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    problem = device_problem(args.device)
    if problem is not None:
        print(f"gpu_check: NO DEVICE: {problem}", file=sys.stderr)
        return EXIT_NO_DEVICE
    report = Report()
    report.say(f"device {args.device}, {args.sessions} sessions x {args.steps} steps, latent {args.latent_shape}")
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(checks(args, report), args.budget_s))
    except CheckFailed as exc:
        print(f"gpu_check: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except TimeoutError:
        print(f"gpu_check: FAILED: the checks did not finish within {args.budget_s:.0f}s", file=sys.stderr)
        return EXIT_FAILED
    report.say(f"all checks passed in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
