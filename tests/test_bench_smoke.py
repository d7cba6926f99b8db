"""The benchmark suite runs end to end at smoke size. Benchmarks are not tests: no speed is asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import run_all
from bench.common import REPO


@pytest.mark.slow
@pytest.mark.timeout(900)  # every benchmark in turn, ~5 minutes at smoke size on 2 cores
def test_bench_smoke_runs_every_benchmark(tmp_path: Path) -> None:
    results, plot = tmp_path / "latest.json", tmp_path / "latency.png"
    code = run_all.main(["--size", "smoke", "--no-progress", "--results", str(results), "--plot", str(plot)])
    assert code == 0
    report = json.loads(results.read_text(encoding="utf-8"))
    assert report["failed"] == []
    assert {row["bench"] for row in report["rows"]} >= set(run_all.BENCHMARKS)
    assert plot.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("baseline_first", [False, True], ids=["this checkout first", "baseline first"])
def test_step_cpu_measures_this_checkout_beside_a_worktree_of_a_revision(baseline_first: bool) -> None:
    from bench import step_cpu

    rows = step_cpu.run("smoke", "HEAD", baseline_first=baseline_first)
    systems = {(row.case.split()[0], row.system) for row in rows}
    assert systems == {(case, system) for case in ("tiny", "latent")
                       for system in ("fleet @ this checkout", "fleet @ HEAD", "this checkout / HEAD")}
    for row in rows:
        if row.system.startswith("fleet @"):
            assert row.values["steps_s"] > 0 and row.values["cpu_us_total"] > 0, row
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True,
                               text=True, check=True).stdout
    assert "bench-rev-" not in worktrees  # the temporary checkout is gone


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_step_cpu_counts_the_instructions_of_the_trainer_and_the_worker_under_callgrind(tmp_path: Path) -> None:
    from bench import step_cpu
    from bench.step_cpu_child import CASES

    rows = step_cpu.run_counted("smoke", None, str(tmp_path))
    assert [row.case.split()[0] for row in rows] == list(CASES)
    for row in rows:
        sessions = CASES[row.case.split()[0]][1]
        assert row.values["steps"] == sessions * step_cpu.COUNTED_STEPS["smoke"], row
        assert row.values["kinstr_client"] > 0 and row.values["kinstr_workers"] > 0, row
        assert row.values["kinstr_total"] == pytest.approx(row.values["kinstr_client"] + row.values["kinstr_workers"])



async def test_script_batching_does_the_same_commits_both_ways() -> None:
    """The two ways compared do the same work: after each, every stand-in session of the batch has
    committed the last step and holds one stream entry per step."""
    from redis.asyncio import Redis

    from bench import script_batching as sb
    from bench.common import private_redis

    batch, steps = 8, 40
    with private_redis() as server:
        redis = Redis.from_url(server.url)
        try:
            for way, script in (("pipeline", sb.ONE_STEP), ("one call", sb.WHOLE_BATCH)):
                await redis.flushall()
                client_us, redis_us = await sb.measure(redis, way, await redis.script_load(script), batch, steps)
                assert client_us > 0 and redis_us >= 0, way
                for i in range(batch):
                    (session, replies, _), _ = sb.stand_in_step(batch, i, 0)
                    assert await redis.hget(session, "committed") == str(steps // batch - 1).encode(), way
                    assert await redis.xlen(replies) == steps // batch, way
        finally:
            await redis.aclose()
    rows = await sb.run("smoke")
    assert {(row.case, row.system) for row in rows} == {
        (f"batch of {n}", way) for n in sb.BATCHES for way in ("pipeline", "one call", "saved by one call")}


async def test_hot_path_times_each_piece_both_ways() -> None:
    """Every piece is timed both ways, and the two ways of the digest give the same bytes (run
    asserts it before timing them)."""
    from bench import hot_path

    rows = await hot_path.run("smoke")
    assert {row.case for row in rows} == {
        "pool check of an idle connection", "pooled PING, round trip",
        "pool hand-out and take-back of an idle connection", "output digest, tiny world step",
        "pack enqueue EVALSHA (16 args)", "pack commit EVALSHA (24 args)", "job id", "as_floats, 8 values",
        "frozen records of a tiny world step", "commit wait, cancellation held"}
    assert all(row.values["before_us"] > 0 and row.values["after_us"] > 0 for row in rows)


async def test_consumer_read_takes_every_result_each_way() -> None:
    """Each way of taking results (read only, ack each, ack_many per read) takes every entry of the
    prepared stream (take_all raises otherwise), for inline and blob results alike."""
    from bench import consumer_read

    rows = await consumer_read.run("smoke")
    assert {(row.case.split()[0], row.system) for row in rows} == {
        (kind, way) for kind in consumer_read.SHAPES for way in consumer_read.WAYS}
    assert all(row.values["deliveries_s"] > 0 for row in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_gc_pauses_times_both_processes_with_and_without_the_tuning() -> None:
    """Every round reports the worker's and the trainer's collections of its window, the worker's
    from its child (written on SIGUSR1), for tiny and latent results, tuned and not."""
    from bench import gc_pauses

    rows = await gc_pauses.run("smoke")
    assert len(rows) == 8 and {row.case.split()[0] for row in rows} == {"tiny", "latent"}
    assert sum("python defaults" in row.system and row.system.startswith("worker") for row in rows) == 2
    for row in rows:
        assert {"young_n", "middle_n", "full_n", "full_max_ms"} <= set(row.values)
        if row.system.startswith("trainer"):
            assert row.values["n"] > 0 and row.values["errors"] == 0
