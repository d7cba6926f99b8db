"""Multi-turn token rollouts against a real vLLM (the CPU tier's tiny Llama), three ways, same
conversations, same seeds, same tokens out:

- ``direct``: the way vime/slime roll out: each conversation keeps its own context and POSTs it to
  vLLM's token-in/token-out ``/inference/v1/generate`` through a session-affine router (a session
  stays on the server that saw its first turn, so that server's prefix cache holds its context);
- ``fleet vllm-http``: the same server behind one fleet worker (``vllm-http`` engine), and behind one
  worker per session (no two sessions' turns share a worker's engine batch);
- ``fleet vllm``: one fleet worker running vLLM in process (``vllm`` engine).

A conversation is the vime geo3k shape: a prompt, then observation turns appended to the context,
each turn generating ``max_tokens`` with seeded sampling. Every conversation runs at once (the
trainer's concurrency); tokens/s counts generated tokens over the run's wall time; per-turn latency
is one turn's request to answer. The prefix cache is emptied before each run of the server and
every round has fresh prompts, so no system reuses another's cache. The fleet runs create their
sessions inside the timed run (a fleet rollout pays for it). Tokens that differ between systems are
printed and make the command exit 1.

    PYTHONPATH=. ~/.cache/rollout-fleet/engines-venv/bin/python -m bench.real_tokens --size smoke|full
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
from bench.real_common import VLLM_ENV, checked_main, fleet_of, tiny_model, vllm_server
from schemas.messages import TokenStep
from workers.engines.base import Engine
from workers.engines.token_sessions import DEFAULT_SEED, sampling_fields
from workers.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from workers.engines.vllm_http import VLLMHTTPConfig, VLLMHTTPEngine

MODEL = "tiny-llama"
BENCH = "real_tokens"
VOCAB = (7, 390)  # the tiny tokenizer's ordinary tokens (0-6 are special)
RUN_TIMEOUT_S = 900.0
Turn = dict[str, Any]  # Session.step keyword arguments: token_ids, sampling


@dataclass(frozen=True)
class Size:
    sessions: int
    turns: int
    prompt_len: int
    obs_len: int
    max_tokens: int
    rounds: int


SIZES = {"smoke": Size(sessions=4, turns=3, prompt_len=24, obs_len=8, max_tokens=8, rounds=1),
         "full": Size(sessions=16, turns=4, prompt_len=64, obs_len=16, max_tokens=32, rounds=2)}


def conversations(size: Size, round_no: int) -> list[list[Turn]]:
    """Each conversation: the prompt, then observation turns; seeded sampling per turn."""
    out = []
    for k in range(size.sessions):
        rng = np.random.default_rng([round_no, k])
        turns = []
        for t in range(size.turns):
            n = size.prompt_len if t == 0 else size.obs_len
            ids = [int(i) for i in rng.integers(*VOCAB, size=n)]
            turns.append({"token_ids": [1, *ids] if t == 0 else ids,
                          "sampling": {"max_tokens": size.max_tokens, "temperature": 1.0,
                                       "seed": 10_000 * round_no + 100 * k + t}})
        out.append(turns)
    return out


@dataclass
class Run:
    """One system's run of one round: generated tokens per conversation and turn, timings."""

    tokens: list[list[list[int]]]
    turn_ms: list[float]
    wall_s: float

    @property
    def generated(self) -> int:
        return sum(len(t) for conv in self.tokens for t in conv)


async def timed(convs: list[list[Turn]], rollout: Callable[[int, list[Turn], list[float]], Awaitable[list[list[int]]]],
                ) -> Run:
    turn_ms: list[float] = []
    started = time.perf_counter()
    tokens = await asyncio.wait_for(asyncio.gather(*(rollout(k, c, turn_ms) for k, c in enumerate(convs))),
                                    RUN_TIMEOUT_S)
    return Run(list(tokens), turn_ms, time.perf_counter() - started)


# --------------------------------------------------------------------------- the direct path


class SessionRouter:
    """vime/slime's router, session-affine: a session's first request goes to the server with the
    fewest pinned sessions, every later one to the same server (its prefix cache holds the
    session's context). With one server the choice is trivial; the shape is the general one."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 300.0) -> None:
        self.clients = [httpx.AsyncClient(base_url=u, timeout=timeout_s,
                                          limits=httpx.Limits(max_connections=256)) for u in urls]
        self.pinned: dict[str, int] = {}
        self.load = [0] * len(urls)

    def client(self, session_id: str) -> httpx.AsyncClient:
        index = self.pinned.get(session_id)
        if index is None:
            index = min(range(len(self.clients)), key=self.load.__getitem__)
            self.pinned[session_id] = index
            self.load[index] += 1
        return self.clients[index]

    def release(self, session_id: str) -> None:
        index = self.pinned.pop(session_id, None)
        if index is not None:
            self.load[index] -= 1

    async def generate(self, session_id: str, context: list[int], turn: Turn) -> list[int]:
        # The same sampling fields the fleet's engines send (logprobs=0, the seed always set).
        params = sampling_fields(TokenStep.from_wire(turn).sampling, DEFAULT_SEED)
        body = {"model": MODEL, "token_ids": context, "sampling_params": params, "stream": False}
        response = await self.client(session_id).post("/inference/v1/generate", json=body)
        response.raise_for_status()
        return [int(t) for t in response.json()["choices"][0]["token_ids"]]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


async def direct_run(urls: Sequence[str], convs: list[list[Turn]]) -> Run:
    router = SessionRouter(urls)

    async def rollout(k: int, turns: list[Turn], turn_ms: list[float]) -> list[list[int]]:
        sid = f"rollout-{k}-{uuid.uuid4().hex[:6]}"
        context: list[int] = []
        outs = []
        for turn in turns:
            context += turn["token_ids"]
            started = time.perf_counter()
            out = await router.generate(sid, context, turn)
            turn_ms.append((time.perf_counter() - started) * 1000)
            context += out
            outs.append(out)
        router.release(sid)
        return outs

    try:
        return await timed(convs, rollout)
    finally:
        await router.aclose()


async def reset_prefix_cache(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        (await client.post("/reset_prefix_cache")).raise_for_status()


# --------------------------------------------------------------------------- through the fleet


async def fleet_runs(url: str, engines: Sequence[Engine], rounds: list[list[list[Turn]]],
                     before: Callable[[], Awaitable[None]] | None = None) -> tuple[list[Run], dict[str, float]]:
    """Every round through in-process workers, one per engine; the runs and the batch sizes."""
    runs = []
    async with fleet_of(url, f"brt{uuid.uuid4().hex[:6]}", engines) as fleet:
        for convs in rounds:
            if before is not None:
                await before()

            async def rollout(k: int, turns: list[Turn], turn_ms: list[float]) -> list[list[int]]:
                session = await fleet.client.create_session(model=MODEL, mode="tokens")
                outs = []
                for i, turn in enumerate(turns):
                    started = time.perf_counter()
                    r = await session.step(i, **turn)
                    turn_ms.append((time.perf_counter() - started) * 1000)
                    if not r.ok or r.output is None:
                        raise RuntimeError(f"conversation {k} turn {i}: {r.error}")
                    outs.append([int(t) for t in r.output["token_ids"]])
                await session.close()
                return outs

            runs.append(await timed(convs, rollout))
        return runs, fleet.batch_sizes()


def inproc_engine(model_dir: str) -> VLLMEngine:
    return VLLMEngine(VLLMEngineConfig(model=model_dir, served_model_name=MODEL, dtype="float32",
                                       max_model_len=1024, enforce_eager=True, env=VLLM_ENV))


# --------------------------------------------------------------------------- rows and checks


def row(system: str, size: Size, runs: Sequence[Run], batches: dict[str, float] | None = None) -> Row:
    lat = Latencies([ms for run in runs for ms in run.turn_ms])
    summary = lat.summary()
    values = {"tokens_s": sum(r.generated for r in runs) / sum(r.wall_s for r in runs),
              "turn_p50": summary["p50"], "turn_p99": summary["p99"], "tokens": float(sum(r.generated for r in runs))}
    values.update(batches or {})
    case = f"{size.sessions} sessions x {size.turns} turns, {size.max_tokens} new tokens/turn"
    return Row(BENCH, case, system, values, "ms")


def mismatches(reference: Sequence[Run], other: Sequence[Run], name: str) -> list[str]:
    found = []
    for round_no, (a, b) in enumerate(zip(reference, other, strict=True)):
        for k, (conv_a, conv_b) in enumerate(zip(a.tokens, b.tokens, strict=True)):
            for t, (ta, tb) in enumerate(zip(conv_a, conv_b, strict=True)):
                if ta != tb:
                    found.append(f"{name}: round {round_no} conversation {k} turn {t}: direct {ta} != {tb}")
    return found


def http_engines(url: str, count: int) -> list[Engine]:
    return [VLLMHTTPEngine(VLLMHTTPConfig(base_url=url, model=MODEL)) for _ in range(count)]


async def measure(size: Size) -> tuple[list[Row], list[str]]:
    """Round 0 of every system warms up and is not counted. The fleet's vllm-http runs twice: one
    worker for every session (the deployment: a worker fronts a server), and one worker per
    session, where no session's turn ever shares an engine batch with another's."""
    rounds = [conversations(size, r) for r in range(size.rounds + 1)]
    model_dir = tiny_model()
    with private_redis() as redis:
        with vllm_server(model_dir, MODEL) as server:
            async def cold() -> None:
                await reset_prefix_cache(server.url)

            direct = []
            for convs in rounds:
                await cold()
                direct.append(await direct_run([server.url], convs))
            http_runs, http_batches = await fleet_runs(redis.url, http_engines(server.url, 1), rounds, cold)
            apart_runs, apart_batches = await fleet_runs(redis.url, http_engines(server.url, size.sessions),
                                                         rounds, cold)
        inproc_runs, inproc_batches = await fleet_runs(redis.url, [inproc_engine(model_dir)], rounds)
    rows = [row("direct /inference/v1/generate", size, direct[1:]),
            row("fleet vllm-http", size, http_runs[1:], http_batches),
            row(f"fleet vllm-http, {size.sessions} workers", size, apart_runs[1:], apart_batches),
            row("fleet vllm (in process)", size, inproc_runs[1:], inproc_batches)]
    ratio = rows[1].values["tokens_s"] / rows[0].values["tokens_s"]
    rows.append(Row(BENCH, rows[0].case, "fleet vllm-http / direct",
                    {"throughput_ratio": ratio, "overhead_pct": 100.0 * (1.0 - ratio)}, "",
                    "target: overhead <= 5% of direct throughput"))
    bad = (mismatches(direct, http_runs, "fleet vllm-http") + mismatches(direct, apart_runs, "fleet vllm-http apart")
           + mismatches(direct, inproc_runs, "fleet vllm"))
    return rows, bad


def main(argv: list[str] | None = None) -> int:
    return checked_main(argv, prog="python -m bench.real_tokens", sizes=SIZES, measure=measure, what="tokens",
                        unit="turns", same="every turn of every system equals the direct path")


if __name__ == "__main__":
    raise SystemExit(main())
