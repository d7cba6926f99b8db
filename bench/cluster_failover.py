"""A Redis Cluster master failover, seen by a trainer: SIGKILL the master of the cell's slot while
one session steps, and time the gap between the last step committed before the kill and the first
one after it (the replica's promotion, about two node timeouts, plus the clients' backoff).

Stands alone (``python -m bench.cluster_failover --runs 3``): a local 3+3 cluster per run, one
in-process null-engine worker, one session stepping back to back. docs/cluster.md has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
import uuid

from redis.crc import key_slot

from broker import FleetClient
from broker.redis.embedded_cluster import NODE_TIMEOUT_MS, find_redis_cli, running_cluster
from broker.redis.keys import CellKeys
from workers.engines.null import NullEngine
from workers.settings import WorkerSettings
from workers.worker import Worker

STEP = {"observation": {"prompt": "p", "state": [0.0] * 8},
        "action": {"joint_positions": [0.1] * 7, "gripper_position": [0.5]}}
LEASE_MS = 20_000  # longer than the failover: the worker keeps its session


async def one_run() -> float:
    """Seconds from the kill to the first step committed after it."""
    with running_cluster() as cluster:
        prefix = f"b{uuid.uuid4().hex[:8]}"
        settings = WorkerSettings.from_mapping({"redis_url": cluster.url, "prefix": prefix, "lease_ms": LEASE_MS,
                                                "heartbeat_ms": 500})
        worker = Worker(NullEngine(), settings)
        await worker.start()
        serving = asyncio.create_task(worker.serve())
        try:
            async with FleetClient(cluster.url, prefix=prefix, lease_ms=LEASE_MS) as fleet:
                session = await fleet.create_session(model="null-world", mode="world_model_env")
                for i in range(20):
                    await session.step(i, **STEP)
                master = cluster.master_of_slot(key_slot(CellKeys().cell.encode()))
                subprocess.run([find_redis_cli(), "-p", str(master.port), "WAIT", "1", "5000"],
                               capture_output=True, timeout=10, check=True)
                killed = time.monotonic()
                master.stop(kill=True)
                result = await asyncio.wait_for(session.step(20, **STEP), 120)
                assert result.ok, result.error
                return time.monotonic() - killed
        finally:
            worker.request_stop()
            await asyncio.wait_for(serving, 60)
            await worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    gaps = [asyncio.run(one_run()) for _ in range(runs)]
    print(f"cluster-node-timeout {NODE_TIMEOUT_MS} ms; kill -> next step committed (s): "
          f"{', '.join(f'{g:.2f}' for g in gaps)}; median {statistics.median(gaps):.2f}")


if __name__ == "__main__":
    main()
