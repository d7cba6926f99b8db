"""One compose project of docker-compose.yml, driven through the docker CLI: up, scale, run the
demo trainer, kill and stop containers, reach published ports, take it down. Every call has a
bound; a failed call raises with its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UP_S = 300  # `up --wait`: image start, worker registration, healthchecks (start_period 60 s)
CALL_S = 120  # any other docker call
TRAINER_S = 600  # a demo trainer run (the longest steps 30 sessions x 60 steps on 2 loaded cores)


@dataclass(frozen=True)
class ComposeCell:
    root: Path
    project: str
    env_file: Path
    password: str

    def compose(self, *args: str, timeout: float = CALL_S, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), *args]
        done = subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def up(self, *extra: str) -> None:
        self.compose("up", "-d", "--wait", "--wait-timeout", str(UP_S - 30), *extra, timeout=UP_S)

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.compose("--profile", "trainer", "--profile", "monitoring", "down", "-v", "--remove-orphans",
                            "--timeout", "60", timeout=UP_S, check=False)

    # ---- containers
    def containers(self, *services: str) -> list[dict[str, Any]]:
        """The running containers of ``services`` (all services when none is named)."""
        args = ["ps", "--format", "json", *services]
        out = self.compose(*args).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def inspect(self, name: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, timeout=CALL_S, check=True)
        found: list[dict[str, Any]] = json.loads(out.stdout)
        return found[0]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        kinds = {"containers": ["docker", "ps", "-a", "-q", "--filter", label],
                 "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
                 "networks": ["docker", "network", "ls", "-q", "--filter", label]}
        return {kind: subprocess.run(argv, capture_output=True, text=True, timeout=CALL_S, check=True).stdout.split()
                for kind, argv in kinds.items()}

    # ---- published ports
    def published(self, service: str, port: int, index: int = 1) -> str:
        """host:port Docker published ``service``'s container ``port`` on (replica ``index``)."""
        return self.compose("port", "--index", str(index), service, str(port)).stdout.strip()

    def http(self, service: str, port: int, path: str, index: int = 1) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://{self.published(service, port, index)}{path}", timeout=10) as reply:
            return int(reply.status), reply.read().decode()

    def json_get(self, service: str, port: int, path: str) -> Any:
        return json.loads(self.http(service, port, path)[1])

    def redis_url(self) -> str:
        return f"redis://:{self.password}@{self.published('redis', 6379)}/0"

    def status(self) -> dict[str, Any]:
        """`rollout-fleet status --json` from this host, through Redis's published port (the URL in
        the environment, never argv)."""
        env = {**os.environ, "ROLLOUT_FLEET_REDIS_URL": self.redis_url()}
        done = subprocess.run([sys.executable, "-m", "cli.main", "status", "--json"], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=CALL_S, check=True)
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    # ---- the demo trainer of the trainer profile
    def trainer(self, *args: str) -> subprocess.Popen[str]:
        argv = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), "--profile", "trainer",
                "run", "--rm", "-T", "trainer", *args]
        return subprocess.Popen(argv, cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(trainer: subprocess.Popen[str], timeout: float = TRAINER_S) -> tuple[int, str]:
    try:
        out, _ = trainer.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        trainer.kill()
        out, _ = trainer.communicate(timeout=CALL_S)
        raise AssertionError(f"the trainer did not finish within {timeout}s:\n{out}") from None
    return trainer.returncode, out


def until(what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
    """Poll ``check()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s")
