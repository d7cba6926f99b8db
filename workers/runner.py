"""Run one worker process until SIGTERM/SIGINT, then drain: finish in-flight jobs and exit."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
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


def tune_malloc() -> bool:
    """Keep freed large blocks in the process (glibc): a worker allocates a fresh latent-sized
    buffer per step, and returning each to the kernel makes every page of the next one a page
    fault (measured: codec encode of a 450 KB latent 1.22 -> 0.09 ms; docs/benchmarks.md).
    The cost is a resident size bounded by the peak. Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, 64 << 20) and libc.mallopt(m_trim_threshold, 256 << 20))
    except (OSError, AttributeError):
        return False


def run_worker(engine_name: str, settings: WorkerSettings, engine_options: Mapping[str, Any]) -> None:
    tune_malloc()
    asyncio.run(serve_worker(engine_name, settings, engine_options))
