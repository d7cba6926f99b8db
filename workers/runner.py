"""Run one worker process until SIGTERM/SIGINT, then drain: finish in-flight jobs and exit."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping
from typing import Any

from workers.engines.registry import build_engine
from workers.settings import WorkerSettings
from workers.worker import Worker

log = logging.getLogger(__name__)


async def serve_worker(engine_name: str, settings: WorkerSettings, engine_options: Mapping[str, Any]) -> None:
    engine = build_engine(engine_name, engine_options)
    async with Worker(engine, settings) as worker:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.request_stop)
        await worker.serve()
        log.info("worker %s drained: %d steps committed", worker.id, worker.executor.committed_steps)


def run_worker(engine_name: str, settings: WorkerSettings, engine_options: Mapping[str, Any]) -> None:
    asyncio.run(serve_worker(engine_name, settings, engine_options))
