"""A local Redis Cluster: ``masters`` masters with ``replicas`` replicas each, private processes on
free ports, joined by ``redis-cli --cluster create``. For the tests' cluster tier, the benches and
``rollout-fleet redis --cluster`` (a cluster to try the fleet on, not to run production on)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from broker.redis.embedded import RedisServer, find_redis_server, free_port

NODE_TIMEOUT_MS = 2000  # how long a silent master stays a master: failover takes about twice this


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    return free_port(count=2, stride=10000)


def find_redis_cli() -> str:
    beside = Path(find_redis_server()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if found:
        return found
    raise FileNotFoundError("no redis-cli beside redis-server or on PATH: it is needed to create a cluster")


@dataclass
class RedisCluster:
    masters: int = 3
    replicas: int = 1
    server_args: list[str] = field(default_factory=list)  # more redis-server arguments for every node
    nodes: list[RedisServer] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node (any one would do)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 60.0) -> RedisCluster:
        self._tmp = tempfile.TemporaryDirectory(prefix="rollout-fleet-cluster-")
        for i in range(self.masters * (1 + self.replicas)):
            directory = Path(self._tmp.name) / f"node{i}"
            directory.mkdir()
            node = RedisServer(port=cluster_port(), directory=str(directory), extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), *self.server_args])
            self.nodes.append(node.start())
        create = [find_redis_cli(), "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                  "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            self.cleanup()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout.decode()[-2000:]}")
        self.wait_ok(timeout)
        self.wait_synced(timeout)
        return self

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every running node says ``cluster_state:ok`` (slots covered, one master each)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.info(n).get("cluster_state") == "ok" for n in self.running()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the cluster did not reach cluster_state:ok within {timeout}s")

    def wait_synced(self, timeout: float = 60.0) -> None:
        """Until every running replica's link to its master is up. A master's first sync waits
        ``repl-diskless-sync-delay`` (5 s) after ``cluster_state:ok``; a replica promoted before
        it is empty, and one that never synced refuses to fail over at all ("disconnected from
        master for longer than allowed"). Tests that kill a master wait for this first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            replicas = [n for n in self.running() if self.role(n) == "slave"]
            if all("master_link_status:up" in self._cli(n, "INFO", "replication") for n in replicas):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the cluster's replicas did not finish their first sync within {timeout}s")

    def running(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def role(self, node: RedisServer) -> str:
        return self._cli(node, "ROLE").split("\n", 1)[0].strip()

    def master_of_slot(self, slot: int) -> RedisServer:
        """The running node that serves ``slot`` as master now."""
        for node in self.running():
            if self.role(node) == "master" and self._owns(node, slot):
                return node
        raise LookupError(f"no running master serves slot {slot}")

    def info(self, node: RedisServer) -> dict[str, str]:
        text = self._cli(node, "CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def cleanup(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop(kill=True)
        self.nodes.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _owns(self, node: RedisServer, slot: int) -> bool:
        for line in self._cli(node, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if "myself" not in parts[2]:
                continue
            for span in parts[8:]:
                if span.startswith("["):  # a slot being migrated
                    continue
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return True
        return False

    def _cli(self, node: RedisServer, *args: str) -> str:
        done = subprocess.run([find_redis_cli(), "-p", str(node.port), *args], capture_output=True, timeout=10,
                              check=False)
        return done.stdout.decode()


@contextlib.contextmanager
def running_cluster(masters: int = 3, replicas: int = 1,
                    server_args: list[str] | None = None) -> Iterator[RedisCluster]:
    cluster = RedisCluster(masters, replicas, list(server_args or [])).start()
    try:
        yield cluster
    finally:
        cluster.cleanup()
