"""A simulated GPU engine: one forward of a batch of n takes ``a + b*n`` ms, one forward at a time.

A fleet worker runs it like any engine:

    rollout-fleet worker --engine bench.sim_engine:SimEngine --engine-opt a_ms=20 --engine-opt b_ms=0.5 \
        --engine-opt max_batch=32 --engine-opt stats_path=/tmp/stats.json

The forward is an ``asyncio.sleep`` behind a lock: like a GPU, the device is busy for the whole
forward, and the host's event loop stays free meanwhile. ``stats_path``: where ``close`` writes the
engine's counters (JSON), so the benchmark can read them after the worker drained.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from schemas.messages import Mode
from workers.engines.base import Engine, EngineOutput, EngineRequest

SIM_MODEL = "sim-world"


@dataclass(frozen=True)
class SimEngineConfig:
    a_ms: float = 20.0  # fixed cost of a forward (kernel launches, weights streamed once)
    b_ms: float = 0.5  # per-request cost inside the batch
    max_batch: int = 32
    stats_path: str | None = None  # close() writes the engine counters (JSON) here

    def forward_ms(self, n: int) -> float:
        return self.a_ms + self.b_ms * n

    def max_steps_per_s(self) -> float:
        """The engine's ceiling: full batches back to back."""
        return self.max_batch / self.forward_ms(self.max_batch) * 1000.0


class SimEngine(Engine):
    kind = "sim-gpu"
    config_type = SimEngineConfig

    def __init__(self, config: SimEngineConfig | None = None) -> None:
        self.config = config or SimEngineConfig()
        self._device: asyncio.Lock | None = None
        self._contexts: dict[str, int] = {}
        self.forwards = 0
        self.items = 0
        self.busy_s = 0.0

    def models(self) -> Mapping[str, Mode]:
        return {SIM_MODEL: Mode.WORLD_MODEL_ENV}

    def max_batch_size(self, model: str) -> int:
        return self.config.max_batch

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        if self._device is None:
            self._device = asyncio.Lock()
        async with self._device:  # one forward at a time: the device is exclusive
            started = time.perf_counter()
            await asyncio.sleep(self.config.forward_ms(len(requests)) / 1000.0)
            self.busy_s += time.perf_counter() - started
        self.forwards += 1
        self.items += len(requests)
        outs: list[EngineOutput | BaseException] = []
        for req in requests:
            seen = 0 if (req.reset or req.stateless) else self._contexts.get(req.session_key, 0)
            if not req.stateless:
                self._contexts[req.session_key] = seen + 1
            outs.append(EngineOutput(output={"context": seen}, context_length=seen + 1))
        return outs

    def drop_session(self, session_key: str) -> None:
        self._contexts.pop(session_key, None)

    def stats(self) -> dict[str, float]:
        return {"forwards": self.forwards, "items": self.items, "busy_s": self.busy_s,
                "mean_batch": self.items / self.forwards if self.forwards else 0.0,
                "mean_forward_ms": 1000.0 * self.busy_s / self.forwards if self.forwards else 0.0}

    async def close(self) -> None:
        if self.config.stats_path:
            with open(self.config.stats_path, "w", encoding="utf-8") as fh:
                json.dump(self.stats(), fh)
