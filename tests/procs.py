"""Real processes for integration and chaos tests: workers and supervisors started via the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from broker.ops.status import cell_status

CLI = [sys.executable, "-m", "workers.cli", "--log-level", "WARNING"]


@dataclass
class Fleet:
    """Worker and supervisor processes of one cell; everything is killed on close."""

    url: str
    prefix: str
    heartbeat_ms: int = 200
    lease_ms: int = 1000
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def worker(self, *extra: str, engine: str = "null") -> subprocess.Popen[bytes]:
        cmd = [*CLI, "worker", "--redis-url", self.url, "--prefix", self.prefix, "--engine", engine,
               "--heartbeat-ms", str(self.heartbeat_ms), "--lease-ms", str(self.lease_ms), *extra]
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        self.procs.append(proc)
        return proc

    def supervisor(self) -> subprocess.Popen[bytes]:
        cmd = [*CLI, "supervisor", "--redis-url", self.url, "--prefix", self.prefix,
               "--lease-ms", str(self.lease_ms)]
        proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL)
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

    def alive_workers(self) -> list[subprocess.Popen[bytes]]:
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
