"""Run one worker process until SIGTERM/SIGINT, then drain: finish in-flight jobs and exit; a second
SIGTERM/SIGINT during the drain exits at once (its sessions then move by failover)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import signal
from collections.abc import Mapping
from typing import Any

from workers.engines.registry import build_engine
from workers.settings import WorkerSettings
from workers.worker import Worker

log = logging.getLogger(__name__)
# Container allocations (net of frees) between two young-generation collections; Python's default
# is 700. A worker keeps every in-flight step's objects alive across several of those collections,
# so at 700 it collected about 330 times a second at 64 tiny sessions and promoted enough to run a
# full collection every 0.4 s (14-16 ms each, every in-flight step waiting): 7% of its time.
GC_YOUNG_THRESHOLD = 10_000


async def serve_worker(engine_name: str, settings: WorkerSettings, engine_options: Mapping[str, Any]) -> None:
    engine = build_engine(engine_name, engine_options)
    async with Worker(engine, settings) as worker:
        tune_gc()  # after the engine and the worker are up: what exists now lives as long as the process
        serving = asyncio.ensure_future(worker.serve())
        stops = StopSignals(worker, serving)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stops.received, sig)
        try:
            await serving
        except asyncio.CancelledError:
            if not stops.now:
                raise
            log.warning("worker %s stopped without finishing its drain: its sessions move when its lease "
                        "expires", worker.id)
            return
        log.info("worker %s drained: %d steps committed", worker.id, worker.executor.committed_steps)


class StopSignals:
    """The first SIGTERM or SIGINT drains the worker; the second (either) stops it now: its serve
    task is cancelled and the worker shuts down without handing its sessions over. They move by
    failover once its lease expires, their queued and unacknowledged jobs with them."""

    def __init__(self, worker: Worker, serving: asyncio.Future[None]) -> None:
        self.worker = worker
        self.serving = serving
        self.count = 0
        self.now = False

    def received(self, sig: signal.Signals) -> None:
        self.count += 1
        if self.count == 1:
            log.info("%s: draining worker %s (a second SIGTERM or SIGINT stops it now)", sig.name, self.worker.id)
            self.worker.request_stop()
            return
        if not self.now:
            self.now = True
            log.warning("second signal (%s): stopping worker %s now; its sessions fail over after its lease",
                        sig.name, self.worker.id)
            self.serving.cancel()


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the step path. What exists once the worker is up
    (modules, the engine and its weights' Python objects, the worker's own state) is frozen, so
    full collections no longer walk it; young collections run every ``GC_YOUNG_THRESHOLD``
    allocations instead of 700. Garbage collected at once beforehand, so that none is frozen.
    Frozen objects are still freed when their last reference goes, only cycles among them stay:
    safe here because a worker builds its engine once and engines reload weights in place.
    Measured at 64 tiny sessions (``python -m bench.gc_pauses``): worker GC time about 1 s per 15
    s -> none, step p99 27 -> 19 ms (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)
    log.info("garbage collector tuned: %d objects frozen, young-generation threshold %d",
             gc.get_freeze_count(), gc.get_threshold()[0])


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
