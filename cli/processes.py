"""Fleet processes started through the CLI: the one place that builds their command lines.

The demo, the benchmarks and the integration and chaos tests all run real worker (and supervisor)
processes as ``python -m cli.main ... worker ...``; they get the command line and the process
from here, so a flag renamed in the CLI is renamed once. Where a child's output goes stays the
caller's choice (the demo shows it, the benchmarks keep it in a file to quote when a child dies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

Process = subprocess.Popen[bytes]
# Popen's stdout / stderr: None (inherit), subprocess.DEVNULL / PIPE, or an open file.
Redirect = int | IO[Any] | None


def cli_command(verb: str, *args: str, log_level: str | None = "WARNING") -> list[str]:
    """``python -m cli.main [--log-level L] <verb> <args>``; ``None`` keeps the CLI's default."""
    level = [] if log_level is None else ["--log-level", log_level]
    return [sys.executable, "-m", "cli.main", *level, verb, *args]


def worker_command(redis_url: str, prefix: str, *, cell: str | None = None, engine: str = "null",
                   log_level: str | None = "WARNING",
                   latent_shape: Sequence[int] | None = None, device: str | None = None,
                   heartbeat_ms: int | None = None, lease_ms: int | None = None,
                   engine_options: Mapping[str, Any] | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one worker; options left ``None`` keep the CLI's defaults.

    ``engine_options`` become ``--engine-opt KEY=VALUE`` (non-strings JSON-encoded, as the CLI
    parses them); ``extra`` is appended as given.
    """
    args = ["--redis-url", redis_url, "--prefix", prefix, "--engine", engine]
    if cell is not None:
        args += ["--cell", cell]
    if latent_shape is not None:
        args += ["--latent-shape", ",".join(str(int(d)) for d in latent_shape)]
    if device:
        args += ["--device", device]
    args += _optional_ms(heartbeat_ms=heartbeat_ms, lease_ms=lease_ms)
    for key, value in (engine_options or {}).items():
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        args += ["--engine-opt", f"{key}={text}"]
    return cli_command("worker", *args, *extra, log_level=log_level)


def supervisor_command(redis_url: str, prefix: str, *, lease_ms: int | None = None,
                       log_level: str | None = "WARNING") -> list[str]:
    """The command line of the cell's supervisor (reaper, trimming, replays)."""
    args = ["--redis-url", redis_url, "--prefix", prefix, *_optional_ms(lease_ms=lease_ms)]
    return cli_command("supervisor", *args, log_level=log_level)


def _optional_ms(**values: int | None) -> list[str]:
    args: list[str] = []
    for name, value in values.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def spawn(command: Sequence[str], *, env: Mapping[str, str] | None = None, stdout: Redirect = None,
          stderr: Redirect = None) -> Process:
    """Start ``command`` with this process's environment plus ``env``."""
    return subprocess.Popen(list(command), env={**os.environ, **(env or {})}, stdout=stdout, stderr=stderr)


def spawn_worker(redis_url: str, prefix: str, *, stdout: Redirect = None, stderr: Redirect = None,
                 **options: Any) -> Process:
    """Start one worker process; ``options`` are :func:`worker_command`'s."""
    return spawn(worker_command(redis_url, prefix, **options), stdout=stdout, stderr=stderr)


def stop(processes: Iterable[Process], grace_s: float) -> None:
    """SIGTERM every process (a worker drains and exits), then SIGKILL whatever outlives the grace."""
    running = list(processes)
    for proc in running:
        if proc.poll() is None:
            proc.terminate()
    for proc in running:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
