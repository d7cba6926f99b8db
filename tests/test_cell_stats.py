"""The cell's stats stream: histogram percentiles, the summaries workers publish from their
heartbeat, and the failovers reapers note (what the dashboard's rates and latencies come from)."""

from __future__ import annotations

from typing import Any

import pytest

from broker import FleetClient
from broker.ops.cell_stats import BUCKETS_MS, StepSummary, bucket_of, percentile, read_window, summarize
from broker.ops.dashboard_data import DashboardSource
from broker.ops.fleet_dashboard import _merge_windows
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
    assert window.recent_committed == 6
    # The rate from the summaries' own timestamps: six steps over the span they cover (from the
    # oldest one's interval start to the newest), read as of the newest.
    entries: Any = await scripts.redis.xrange(scripts.keys.stats, "-", "+")
    stamps = [(int(eid.split(b"-")[0]), int(fields[b"interval_ms"])) for eid, fields in entries]
    newest_ms, span_ms = stamps[-1][0], stamps[-1][0] - (stamps[0][0] - stamps[0][1])
    assert summarize(entries, 60, newest_ms).steps_per_s == pytest.approx(6 * 1000 / span_ms)

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


def _summary(at_ms: int, worker: str, committed: int, interval_ms: int) -> tuple[bytes, dict[bytes, bytes]]:
    """A stats entry as a worker writes it (its id the Redis time of the XADD)."""
    fields = StepSummary(worker, committed, 0, (committed,) + (0,) * (len(BUCKETS_MS) - 1), interval_ms).fields()
    return f"{at_ms}-0".encode(), {k.encode(): v.encode() for k, v in fields.items()}


def test_steps_per_s_is_the_steps_over_the_span_the_summaries_cover() -> None:
    t0 = 1_000_000_000
    # A fleet ten seconds old (65 steps/s, a summary every 5 s), read 2 s after the last one: 65,
    # not its 650 steps over a whole minute (10.8).
    young = [_summary(t0 + 5000, "w1", 325, 5000), _summary(t0 + 10_000, "w1", 325, 5000)]
    assert summarize(young, 300, t0 + 12_000).steps_per_s == 65.0
    # Two minutes at 65 steps/s: the 13 summaries written in the last minute over the 65 s they
    # cover (the oldest one's interval began 5 s before the minute).
    steady = [_summary(t0 + 5000 * i, "w1", 325, 5000) for i in range(1, 25)]
    window = summarize(steady, 300, t0 + 120_000)
    assert (window.committed, window.recent_committed, window.steps_per_s) == (24 * 325, 13 * 325, 65.0)
    # Two workers add up (65 + 20), whatever the phase of their summaries.
    other = [_summary(t0 + 3000, "w2", 60, 3000), _summary(t0 + 6000, "w2", 60, 3000),
             _summary(t0 + 9000, "w2", 60, 3000)]
    assert summarize(young + other, 300, t0 + 10_000).steps_per_s == 85.0
    # A worker that stopped stepping 25 s ago: its steps over the 30 s since it started (the
    # interval being counted excepted), and nothing at all once its summaries leave the minute.
    assert summarize(young[:1], 300, t0 + 35_000).steps_per_s == 325 / 30
    assert summarize(young, 300, t0 + 80_000).steps_per_s == 0.0
    # A window shorter than the minute rates over itself: only the summary of the last 3 s counts.
    assert summarize(young, 3, t0 + 12_000).steps_per_s == 65.0


def test_every_cells_rate_adds_up_each_cells_workers() -> None:
    t0 = 1_000_000_000
    cells = [summarize([_summary(t0 + 5000, "w1", 325, 5000)], 300, t0 + 6000),
             summarize([_summary(t0 + 4000, "w1", 80, 4000)], 300, t0 + 6000)]
    assert _merge_windows(cells, 300).steps_per_s == 65.0 + 20.0


@pytest.mark.asyncio
async def test_the_dashboards_steps_per_s_from_known_summaries(scripts: Scripts) -> None:
    """2,600 steps committed over the 40 s two summaries cover: the dashboard shows 65 steps/s."""
    redis, keys = scripts.redis, scripts.keys
    seconds, micros = await redis.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    # Written with the ids a worker's XADDs would have got 25 s and 5 s ago (20 s intervals): the
    # figure holds for any read within the next 15 s (then the newest summary is more than one
    # interval old and the span runs on to the read).
    for at_ms, fields in (_summary(now_ms - 25_000, "w1", 1300, 20_000), _summary(now_ms - 5000, "w1", 1300, 20_000)):
        await redis.xadd(keys.stats, fields, id=at_ms.decode())  # type: ignore[arg-type]
    snapshot = await DashboardSource(scripts, lease_ms=2000).snapshot()
    assert snapshot["stats"]["steps_per_s"] == 65.0
    assert snapshot["stats"]["committed"] == 2600
