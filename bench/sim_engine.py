"""A simulated GPU engine: one forward of a batch of n takes ``a + b*n`` ms, one forward at a time.

``python -m bench.sim_engine --redis-url URL --prefix P`` runs a fleet worker with it (the fleet
CLI only knows the registered engines). The forward is an ``asyncio.sleep`` behind a lock: like a
GPU, the device is busy for the whole forward, and the host's event loop stays free meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from schemas.messages import Mode
from workers.engines.base import Engine, EngineOutput, EngineRequest

SIM_MODEL = "sim-world"


@dataclass(frozen=True)
class SimGpuConfig:
    a_ms: float = 20.0  # fixed cost of a forward (kernel launches, weights streamed once)
    b_ms: float = 0.5  # per-request cost inside the batch
    max_batch: int = 32

    def forward_ms(self, n: int) -> float:
        return self.a_ms + self.b_ms * n

    def max_steps_per_s(self) -> float:
        """The engine's ceiling: full batches back to back."""
        return self.max_batch / self.forward_ms(self.max_batch) * 1000.0


class SimGpuEngine(Engine):
    kind = "sim-gpu"

    def __init__(self, config: SimGpuConfig | None = None, stats_path: str | None = None) -> None:
        self.config = config or SimGpuConfig()
        self.stats_path = stats_path
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
        if self.stats_path:
            with open(self.stats_path, "w", encoding="utf-8") as fh:
                json.dump(self.stats(), fh)


async def _serve(url: str, prefix: str, config: SimGpuConfig, stats_path: str | None) -> None:
    from workers.settings import WorkerSettings
    from workers.worker import Worker

    engine = SimGpuEngine(config, stats_path)
    async with Worker(engine, WorkerSettings.from_mapping({"redis_url": url, "prefix": prefix})) as worker:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        await worker.serve()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_engine", description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--a-ms", type=float, default=20.0)
    parser.add_argument("--b-ms", type=float, default=0.5)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--stats", default=None, help="write engine counters (JSON) here on exit")
    args = parser.parse_args(argv)
    config = SimGpuConfig(args.a_ms, args.b_ms, args.max_batch)
    asyncio.run(_serve(args.redis_url, args.prefix, config, args.stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
