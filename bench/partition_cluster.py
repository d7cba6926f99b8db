"""A Redis Cluster master cut off from the majority while a worker and a trainer on its side keep
writing to it (needs root): what a trainer was told was committed, and what is left of it once
the cluster heals, with ``--durability async`` (the default) and ``replicated``.

Six cluster nodes (3 masters, 3 replicas) each in a host of their own (bench/netns.py), a
reference worker in another, the trainer in this process. After a warm-up, the master serving the
cell's slot is cut off from the other five nodes (iptables DROP inside its namespace); the worker
and the trainer still reach it and every other node. The majority promotes its replica after about
two node timeouts; the cut master takes writes until it sees itself in the minority (one node
timeout), then refuses. After ``duration`` the partition heals, the old master rejoins as a replica
of the new one and drops what only it had.

    python -m bench.partition_cluster --duration 10 [--durability async,replicated]   (network site 1)

docs/network-faults.md has the figures; tests/faults/test_minority_master.py asserts that nothing
a trainer was told is lost with ``replicated``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from redis.crc import key_slot

from bench.common import Children
from bench.netns import Host, Network, missing_tools
from bench.partition import ROOT, SHAPE, STEP_TIMEOUT_S, step_inputs
from broker import FleetClient, Session
from broker.redis.embedded import find_redis_server
from broker.redis.embedded_cluster import NODE_TIMEOUT_MS, find_redis_cli
from broker.redis.keys import CellKeys
from cli import processes

PORT = 7000
NODES = 6
LEASE_MS = 30_000  # longer than the partition: the worker keeps its sessions throughout
HEARTBEAT_MS = 500
SESSIONS = 4
PACE_S = 0.05
WARMUP_S = 3.0
SETTLE_S = 5.0  # stepping after the cluster is whole again
RESEND_S = 0.2
START_BOUND_S = 120.0
FINAL = {"step_out_of_order", "step_already_committed", "session_not_found", "context_lost"}  # re-sending won't help


@dataclasses.dataclass
class ClusterOutcome:
    durability: str
    duration_s: float
    told: int  # steps the trainer was told were committed
    lost: int  # of those, steps the healed cluster no longer has
    answers: collections.Counter[str]
    went_on: int  # sessions answered ok after the heal
    sessions: list[str] = dataclasses.field(default_factory=list)  # per session: told, committed, how it ended

    def row(self) -> str:
        errors = ", ".join(f"{code} x{n}" for code, n in sorted(self.answers.items())) or "none"
        return (f"| {self.durability} | {self.duration_s:g} s | {self.told} | {self.lost} | {errors} | "
                f"{self.went_on} of {SESSIONS} |")


HEADER = ("| durability | partition | steps told committed | of them lost after the heal | errors the trainer got "
          "| sessions stepping after the heal |\n|---|---:|---:|---:|---|---:|")


@dataclasses.dataclass
class ClusterLab:
    net: Network
    nodes: list[Host]
    children: Children

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{n.ip}:{PORT}" for n in self.nodes)

    def cli(self, node: Host, *args: str) -> str:
        done = subprocess.run([find_redis_cli(), "-h", node.ip, "-p", str(PORT), *args], capture_output=True,
                              text=True, timeout=10, check=False)
        return done.stdout

    def master_of(self, slot: int) -> Host:
        """The node that serves ``slot`` as master, as the first node sees the cluster."""
        by_address = {f"{n.ip}:{PORT}": n for n in self.nodes}
        for line in self.cli(self.nodes[0], "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            for span in parts[8:]:
                low, _, high = span.partition("-")
                if not span.startswith("[") and int(low) <= slot <= int(high or low):
                    return by_address[parts[1].split("@")[0]]
        raise LookupError(f"no master serves slot {slot}")

    def wait(self, ready: str, what: str) -> None:
        """Until every node's ``CLUSTER INFO`` (``ready`` = "ok") or ``INFO replication`` of each
        replica (``ready`` = "synced") says so."""
        deadline = time.monotonic() + START_BOUND_S
        while time.monotonic() < deadline:
            self.children.check_alive()
            if all(self._ready(node, ready) for node in self.nodes):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{what} not within {START_BOUND_S}s")

    def _ready(self, node: Host, ready: str) -> bool:
        if ready == "ok":
            return "cluster_state:ok" in self.cli(node, "CLUSTER", "INFO")
        replication = self.cli(node, "INFO", "replication")
        return "role:master" in replication or "master_link_status:up" in replication


@contextlib.contextmanager
def cluster_lab(site: int = 1) -> Iterator[ClusterLab]:
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"a partition needs {', '.join(missing)}")
    with Network(site) as net, Children() as children, tempfile.TemporaryDirectory(prefix="rf-netcluster-") as tmp:
        nodes = [net.host(f"n{i}") for i in range(NODES)]
        for i, node in enumerate(nodes):
            folder = Path(tmp) / f"n{i}"
            folder.mkdir()
            children.spawn([*node.prefix(), find_redis_server(), "--bind", node.ip, "--port", str(PORT),
                            "--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                            "--cluster-config-file", str(folder / "nodes.conf"), "--dir", str(folder),
                            "--save", "", "--appendonly", "no", "--protected-mode", "no"])
        one = ClusterLab(net, nodes, children)
        _create(one)
        yield one


def _create(lab: ClusterLab) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not all("PONG" in lab.cli(n, "PING") for n in lab.nodes):
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster's nodes did not start")
        time.sleep(0.1)
    done = subprocess.run([find_redis_cli(), "--cluster", "create", *(f"{n.ip}:{PORT}" for n in lab.nodes),
                           "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True,
                          timeout=START_BOUND_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")
    lab.wait("ok", "cluster_state:ok")
    lab.wait("synced", "the replicas' first sync")


@dataclasses.dataclass
class Told:
    """One session's stepping: the last step answered ok, the errors on the way."""

    last_ok: int = -1
    answers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    final: str = ""  # the answer that ended the session, if one did
    ok_at: float = 0.0  # when the last ok answer came


async def drive(session: Session, k: int, told: Told, stop: asyncio.Event) -> None:
    """Step on, re-sending a step that answered an error, until ``stop`` or an error a re-send
    cannot cure: a session behind the steps the trainer was told about (a lost commit)."""
    i = 0
    while not stop.is_set():
        result = await session.step(i, timeout=STEP_TIMEOUT_S, **step_inputs(k, i))
        if result.ok:
            told.last_ok, told.ok_at = i, time.monotonic()
            i += 1
            await asyncio.sleep(PACE_S)
            continue
        code = str(result.error.code) if result.error else "no output"
        told.answers[code] += 1
        # step_out_of_order with nothing told lost ("send the steps again from the first missing
        # one", after a failover): the same step again. Behind what the trainer was told: lost.
        if code in FINAL and not (code == "step_out_of_order" and result.committed_step_id >= told.last_ok):
            message = result.error.message if result.error else ""
            told.final = f"step {i}: {code} (committed {result.committed_step_id}): {message}"
            return
        await asyncio.sleep(RESEND_S)


async def minority_master(durability: str, duration_s: float) -> ClusterOutcome:
    with cluster_lab() as lab:
        prefix = f"c{uuid.uuid4().hex[:8]}"
        master = lab.master_of(int(key_slot(CellKeys(prefix).cell.encode())))
        worker = lab.net.host("w")
        lab.children.spawn([*worker.prefix(), *processes.worker_command(
            lab.url, prefix, engine="reference", latent_shape=SHAPE, heartbeat_ms=HEARTBEAT_MS, lease_ms=LEASE_MS,
            extra=["--durability", durability])], env={"PYTHONPATH": str(ROOT)})
        async with FleetClient(lab.url, prefix=prefix, step_timeout=STEP_TIMEOUT_S, lease_ms=LEASE_MS) as fleet:
            sessions = await _sessions(fleet, lab)
            told = [Told() for _ in sessions]
            stop = asyncio.Event()
            tasks = [asyncio.create_task(drive(s, k, t, stop)) for k, (s, t) in enumerate(zip(sessions, told,
                                                                                               strict=True))]
            await asyncio.sleep(WARMUP_S)
            others = [n for n in lab.nodes if n is not master]
            for node in others:
                lab.net.cut(node, master)
            await asyncio.sleep(duration_s)
            for node in others:
                lab.net.heal(node, master)
            healed = time.monotonic()
            await asyncio.to_thread(lab.wait, "ok", "the healed cluster")
            await asyncio.sleep(SETTLE_S)
            stop.set()
            await asyncio.gather(*tasks)
            committed = [(await s.status()).committed_step_id for s in sessions]
    answers: collections.Counter[str] = collections.Counter()
    for t in told:
        answers.update(t.answers)
    lost = sum(max(0, t.last_ok - c) for t, c in zip(told, committed, strict=True))
    return ClusterOutcome(durability, duration_s, sum(t.last_ok + 1 for t in told), lost, answers,
                          sum(t.ok_at > healed for t in told),
                          [f"told {t.last_ok}, has {c}; {t.final or 'went on'}" for t, c in zip(told, committed,
                                                                                               strict=True)])


async def _sessions(fleet: FleetClient, lab: ClusterLab) -> list[Session]:
    deadline = time.monotonic() + START_BOUND_S
    while True:
        try:
            return [await fleet.create_session(model="reference-world", mode="world_model_env")
                    for _ in range(SESSIONS)]
        except Exception:
            lab.children.check_alive()
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)  # the worker is still starting


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds the master is cut off")
    parser.add_argument("--durability", default="async,replicated")
    args = parser.parse_args(argv)
    print(HEADER, flush=True)
    for mode in args.durability.split(","):
        outcome = asyncio.run(minority_master(mode.strip(), args.duration))
        print(outcome.row(), flush=True)
        for line in outcome.sessions:
            print(f"  {line}", flush=True)


if __name__ == "__main__":
    main()
