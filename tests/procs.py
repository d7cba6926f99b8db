"""Real processes for integration and chaos tests: workers and supervisors started via the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from dataclasses import dataclass, field

from broker.ops.status import cell_status
from cli.processes import Process, spawn, spawn_worker, supervisor_command


@dataclass
class Fleet:
    """Worker and supervisor processes of one cell; everything is killed on close."""

    url: str
    prefix: str
    heartbeat_ms: int = 200
    lease_ms: int = 1000
    procs: list[Process] = field(default_factory=list)

    def worker(self, *extra: str, engine: str = "null") -> Process:
        proc = spawn_worker(self.url, self.prefix, engine=engine, heartbeat_ms=self.heartbeat_ms,
                            lease_ms=self.lease_ms, extra=extra)
        self.procs.append(proc)
        return proc

    def supervisor(self) -> Process:
        proc = spawn(supervisor_command(self.url, self.prefix, lease_ms=self.lease_ms), stdout=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    async def wait_active(self, count: int, timeout: float = 90.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                report = await cell_status(self.url, prefix=self.prefix)
                live = [w.worker_id for w in report.workers
                        if w.fields.get("state") == "active" and w.heartbeat_age_ms <= self.lease_ms]
                if len(live) >= count:
                    return live
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{count} live workers did not show up")

    def alive_workers(self) -> list[Process]:
        return [p for p in self.procs if p.poll() is None and "worker" in p.args]  # type: ignore[operator]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
