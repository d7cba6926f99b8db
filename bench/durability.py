"""Durable commits: what ``--durability replicated`` costs per step, and what ``async`` risks.

Latency: one null-engine worker process, sessions stepping closed loop, in both durability modes,
on a master + replica pair (``redis-server --replicaof``) and on a local Redis Cluster (3 masters +
3 replicas, broker.redis.embedded_cluster). Failover: a fresh cluster per run, two worker
processes and sessions stepping; the master of the cell's slot is SIGKILLed a second in; the rows
say how long until its replica served the slot, and how many steps the trainer had been told were
committed that the promoted replica did not hold (read from it right after the promotion).

    python -m bench.durability --size smoke|full
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from redis.crc import key_slot

from bench.common import (
    Children,
    Latencies,
    Row,
    module_main,
    new_prefix,
    start_fleet_workers,
    world_inputs,
)
from broker import FleetClient, Session
from broker.redis.connect import open_redis
from broker.redis.durability import DURABILITY_MODES
from broker.redis.embedded import RedisServer
from broker.redis.embedded_cluster import RedisCluster, running_cluster
from broker.redis.keys import CellKeys

NAME = "durability"
LEASE_MS = 15_000  # longer than a failover: the workers ride it out instead of failing over themselves


@dataclass(frozen=True)
class Size:
    steps: int  # measured steps per (mode, concurrency)
    sessions: tuple[int, ...]  # concurrencies
    runs: int  # failovers per mode


SIZE = {"smoke": Size(steps=64, sessions=(1, 8), runs=1), "full": Size(steps=640, sessions=(1, 16), runs=5)}
SYNC_BOUND_S = 120.0


@contextlib.contextmanager
def master_and_replica() -> Iterator[RedisServer]:
    master = RedisServer(appendfsync="no", extra_args=["--repl-diskless-sync-delay", "0"]).start()
    replica = RedisServer(appendfsync="no", extra_args=["--replicaof", "127.0.0.1", str(master.port)]).start()
    try:
        yield master
    finally:
        replica.cleanup()
        master.cleanup()


async def replica_synced(url: str) -> None:
    """Until the master's replica is online (before that WAIT counts nobody)."""
    redis = open_redis(url, decode_responses=True)
    deadline = time.monotonic() + SYNC_BOUND_S
    try:
        while (await redis.info("replication")).get("slave0", {}).get("state") != "online":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replica of {url} did not sync within {SYNC_BOUND_S}s")
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


async def closed_loop(sessions: list[Session], steps: int) -> Latencies:
    lat = Latencies()

    async def drive(session: Session) -> None:
        for i in range(steps // len(sessions)):
            started = time.perf_counter()
            result = await session.step(i, **world_inputs(i))
            if result.ok:
                lat.samples_ms.append((time.perf_counter() - started) * 1000.0)
            else:
                lat.errors += 1

    await asyncio.gather(*[drive(s) for s in sessions])
    return lat


async def latency(url: str, where: str, size: Size) -> list[Row]:
    rows = []
    for durability in DURABILITY_MODES:
        prefix = new_prefix("du")
        with Children() as children:
            await start_fleet_workers(children, url, prefix, extra=["--durability", durability])
            async with FleetClient(url, prefix=prefix) as fleet:
                for concurrency in size.sessions:
                    sessions = [await fleet.create_session(model="null-world", mode="world_model_env")
                                for _ in range(concurrency)]
                    await closed_loop(sessions, 2 * concurrency)  # warm-up: connections, scripts loaded
                    lat = await closed_loop(sessions, size.steps)
                    rows.append(Row(NAME, f"{where}, {concurrency} sessions", durability, lat.summary(), "ms"))
    return rows


async def failover_run(durability: str) -> tuple[float, int, int]:
    """(seconds until the slot had a master again, steps seen committed, of those missing)."""
    prefix = new_prefix("df")
    keys = CellKeys(prefix)
    with running_cluster() as cluster, Children() as children:
        await asyncio.to_thread(cluster.wait_synced, SYNC_BOUND_S)
        await start_fleet_workers(children, cluster.url, prefix, count=2, lease_ms=LEASE_MS,
                                  extra=["--durability", durability])
        async with FleetClient(cluster.url, prefix=prefix, step_timeout=SYNC_BOUND_S, lease_ms=LEASE_MS) as fleet:
            sessions = [await fleet.create_session(model="null-world", mode="world_model_env") for _ in range(8)]
            seen = [-1] * len(sessions)
            stop = asyncio.Event()

            async def drive(k: int) -> None:
                i = 0
                while not stop.is_set():
                    if (await sessions[k].step(i, **world_inputs(i))).ok:
                        seen[k], i = i, i + 1

            running = asyncio.gather(*[drive(k) for k in range(len(sessions))])
            await asyncio.sleep(1.0)
            victim = cluster.master_of_slot(key_slot(keys.base.encode()))
            told = list(seen)
            victim.stop(kill=True)
            failover_s = await _promoted(cluster, key_slot(keys.base.encode()))
            redis = open_redis(cluster.url)
            held = [int(await redis.hget(keys.session(s.session_id), "committed_step_id")) for s in sessions]
            await redis.aclose()
            victim.start()  # back as a replica: replicated commits need one to finish
            stop.set()
            await asyncio.wait_for(running, SYNC_BOUND_S)
    missing = sum(max(0, t - h) for t, h in zip(told, held, strict=True))
    return failover_s, sum(t + 1 for t in told), missing


async def _promoted(cluster: RedisCluster, slot: int) -> float:
    started = time.monotonic()
    while time.monotonic() - started < SYNC_BOUND_S:
        with contextlib.suppress(LookupError):
            await asyncio.to_thread(cluster.master_of_slot, slot)
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise TimeoutError(f"slot {slot} had no master for {SYNC_BOUND_S}s")


async def run(size: str) -> list[Row]:
    chosen = SIZE[size]
    rows: list[Row] = []
    with master_and_replica() as master:
        await replica_synced(master.url)
        rows += await latency(master.url, "master + replica", chosen)
    with running_cluster() as cluster:
        await asyncio.to_thread(cluster.wait_synced, SYNC_BOUND_S)
        rows += await latency(cluster.url, "cluster 3+3", chosen)
    for durability in DURABILITY_MODES:
        runs = [await failover_run(durability) for _ in range(chosen.runs)]
        rows.append(Row(NAME, f"master SIGKILLed, {len(runs)} runs", durability, {
            "failover_s_max": max(r[0] for r in runs), "failover_s_min": min(r[0] for r in runs),
            "seen_committed": float(sum(r[1] for r in runs)), "missing": float(sum(r[2] for r in runs))},
            note="missing: steps the trainer was told were committed that the promoted replica lacked"))
    return rows


if __name__ == "__main__":
    sys.exit(module_main(NAME, run))
