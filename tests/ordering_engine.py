"""A null engine for priority tests with worker processes: it records the sessions of each batch
it runs, in order, and holds a batch that carries a step with the hold prompt until a file
appears, so that a test builds a known queue behind it (no sleeps, no races).

Options (``--engine-opt``): ``max_batch``; ``record_path``, a file that gets one JSON line per
batch (its session keys, in batch order); ``held_path``, created once a batch holds; ``go_path``,
whose creation lets a held batch run (at most ``hold_s`` later, it runs anyway). Usable as
``--engine tests.ordering_engine:OrderingEngine``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from schemas.messages import WorldStep
from workers.engines.base import EngineLoad, EngineOutput, EngineRequest
from workers.engines.null import NullEngine, NullEngineConfig

HOLD_PROMPT = "hold"


@dataclass(frozen=True)
class OrderingConfig(NullEngineConfig):
    max_batch: int = 2
    record_path: str = ""
    held_path: str = ""
    go_path: str = ""
    hold_s: float = 60.0


class OrderingEngine(NullEngine):
    config_type = OrderingConfig

    def __init__(self, config: OrderingConfig | None = None) -> None:
        super().__init__(config or OrderingConfig())
        self.ordering = config or OrderingConfig()

    def max_batch_size(self, model: str) -> int:
        return self.ordering.max_batch

    def load(self) -> EngineLoad:
        # No engine signal: the heartbeat's pressure is then the worker's running jobs over its
        # capacity, which is how a test sees that the steps it sent were read and queued.
        return EngineLoad()

    async def run_batch(self, model: str, requests: Sequence[EngineRequest]) -> list[EngineOutput | BaseException]:
        if self.ordering.record_path:
            with open(self.ordering.record_path, "a", encoding="utf-8") as out:
                out.write(json.dumps([r.session_key for r in requests]) + "\n")
        if any(isinstance(r.step, WorldStep) and r.step.observation.prompt == HOLD_PROMPT for r in requests):
            await self._hold()
        return await super().run_batch(model, requests)

    async def _hold(self) -> None:
        if self.ordering.held_path:
            Path(self.ordering.held_path).touch()
        go = Path(self.ordering.go_path) if self.ordering.go_path else None
        deadline = time.monotonic() + self.ordering.hold_s
        while go is not None and not go.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
