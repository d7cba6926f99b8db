"""The cell's stats stream: histogram percentiles, the summaries workers publish from their
heartbeat, and the failovers reapers note (what the dashboard's rates and latencies come from)."""

from __future__ import annotations

import pytest

from broker import FleetClient
from broker.ops.cell_stats import BUCKETS_MS, bucket_of, percentile, read_window
from broker.redis.scripts import Scripts
from tests.support import FAST, WorkerPool, reap_until_moved, until, world_step
from workers.engines.null import NullEngine


def test_histogram_percentiles() -> None:
    assert percentile([0] * len(BUCKETS_MS), 0.5) is None
    counts = [0] * len(BUCKETS_MS)
    for ms in [3.0] * 98 + [700.0, 700.0]:  # 98 in (2, 5], two in (500, 1000]
        counts[bucket_of(ms)] += 1
    p50, p99 = percentile(counts, 0.5), percentile(counts, 0.99)
    assert p50 is not None and 2.0 < p50 <= 5.0
    assert p99 is not None and 500.0 < p99 <= 1000.0
    counts = [0] * len(BUCKETS_MS)
    counts[bucket_of(120_000.0)] = 1  # past the last bound: at least 60 s, never infinity
    assert percentile(counts, 0.99) == 60_000.0


@pytest.mark.asyncio
async def test_workers_publish_step_summaries_and_reapers_failovers(
        fleet: FleetClient, workers: WorkerPool, scripts: Scripts) -> None:
    first = await workers.add(NullEngine(), **FAST)
    s = await fleet.create_session(model="null-world", mode="world_model_env")
    for i in range(6):
        assert (await s.step(i, **world_step(i))).ok

    async def six_committed() -> bool:
        return (await read_window(scripts.redis, scripts.keys, 60)).committed >= 6
    await until(six_committed, "a summary of six committed steps", 10.0)
    window = await read_window(scripts.redis, scripts.keys, 60)
    assert window.committed == 6 and window.failed == 0 and window.reporting_workers == 1
    assert sum(window.histogram) == 6 and window.as_json()["p50_ms"] is not None
    assert window.recent_committed == 6 and window.steps_per_s == 6 / 60

    await workers.add(NullEngine(), **FAST)
    await workers.kill(first)
    await reap_until_moved(scripts, first.id)
    failovers = (await read_window(scripts.redis, scripts.keys, 60)).failovers
    assert any(f.worker_id == first.id and f.moved == 1 for f in failovers)


@pytest.mark.asyncio
async def test_a_damaged_entry_counts_as_nothing_and_the_window_still_reads(scripts: Scripts) -> None:
    keys = scripts.keys
    await scripts.redis.xadd(keys.stats, {"kind": "steps", "worker": "w1", "committed": "lots", "hist": "a,,-1"})
    await scripts.redis.xadd(keys.stats, {"kind": "steps", "worker": "w2", "committed": "3", "failed": "1",
                                          "hist": "0,3", "interval_ms": "500"})
    await scripts.redis.xadd(keys.stats, {"kind": "failover", "worker": b"\xff\xfe", "moved": "2"})
    window = await read_window(scripts.redis, keys, 60)
    assert (window.committed, window.failed, window.reporting_workers) == (3, 1, 2)
    assert window.histogram[:2] == [0, 3] and sum(window.histogram) == 3
    assert [(f.worker_id, f.moved) for f in window.failovers] == [("", 2)]
