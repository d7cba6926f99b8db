"""The README's "first fleet" runs as pasted: its three shell commands (a Redis, two workers) and
its script, with only the port changed to a free one."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.redis.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLE_PORT = "6390"  # the port the README's commands and script name
START_S = 60.0  # a Redis and two reference workers start within this (torch imports included)
SCRIPT_S = 120.0

pytestmark = pytest.mark.slow


def block(kind: str) -> str:
    """The fenced block right after the README's ``<!-- first-fleet: KIND -->`` marker."""
    found = re.search(rf"<!-- first-fleet: {kind} -->\n```\w+\n(.*?)```", README.read_text(), flags=re.S)
    assert found, f"README.md has no first-fleet {kind} block"
    return found.group(1)


def commands(port: int) -> list[tuple[dict[str, str], list[str]]]:
    """The shell block's commands, each as (its leading VAR=value assignments, argv)."""
    out = []
    for line in block("shell").replace(EXAMPLE_PORT, str(port)).splitlines():
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            out.append((env, words))
    return out


@pytest.fixture
def first_fleet(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)
    base = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for env, argv in commands(port):
            procs.append(subprocess.Popen(argv, env={**base, **env}, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + START_S
        while True:
            assert all(p.poll() is None for p in procs), "a first-fleet process exited"
            try:
                if client.zcard("rf:{0}:workers") == 2:
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, f"two workers did not register within {START_S} s"
            time.sleep(0.2)
        client.close()
        yield port, tmp_path
    finally:
        for p in reversed(procs):  # workers first, then Redis
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def test_the_readme_has_three_commands_a_redis_and_two_workers() -> None:
    argvs = [argv for _, argv in commands(1234)]
    assert [a[:2] for a in argvs] == [["rollout-fleet", "redis"], ["rollout-fleet", "worker"],
                                      ["rollout-fleet", "worker"]]


def test_the_first_fleet_script_runs_as_pasted(first_fleet: tuple[int, Path]) -> None:
    port, workdir = first_fleet
    script = workdir / "first_fleet.py"
    script.write_text(block("python").replace(EXAMPLE_PORT, str(port)))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=SCRIPT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "done: every step committed exactly once"
