"""A worker process keeps the cyclic garbage collector off its step path (workers.runner.tune_gc):
once it is up, its heap is frozen and young collections run every GC_YOUNG_THRESHOLD allocations."""

from __future__ import annotations

import queue
import re
import subprocess
import threading

from broker.redis.embedded import RedisServer
from cli.processes import worker_command
from workers.runner import GC_YOUNG_THRESHOLD

TUNED = re.compile(r"garbage collector tuned: (\d+) objects frozen, young-generation threshold (\d+)")


def test_a_worker_process_freezes_its_startup_heap_and_raises_the_young_threshold(
        redis_server: RedisServer, prefix: str) -> None:
    found = None
    with subprocess.Popen(worker_command(redis_server.url, prefix, log_level="INFO"),
                          stderr=subprocess.PIPE, text=True) as proc:
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr or ()], daemon=True)
        reader.start()
        seen: list[str] = []
        try:
            while found is None:
                seen.append(lines.get(timeout=60))  # the worker starts in a few seconds
                found = TUNED.search(seen[-1])
                assert found or proc.poll() is None, "".join(seen)
        finally:
            proc.terminate()
            proc.wait(30)
            reader.join(10)
    frozen, threshold = int(found.group(1)), int(found.group(2))
    assert threshold == GC_YOUNG_THRESHOLD
    assert frozen > 10_000  # numpy, redis-py, msgpack and the worker itself: far more than this
