"""bench.step_scripts runs a revision's enqueue and commit scripts beside this checkout's, through
the client's own batched calls. Benchmarks are not tests: no speed is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_scripts
from bench.common import Callgrind, private_redis
from broker.redis.connect import open_redis


@pytest.mark.asyncio
async def test_a_round_is_one_batched_call_of_each_script_and_commits_every_step() -> None:
    with private_redis() as server:
        redis = open_redis(server.url, decode_responses=False)
        try:
            side = step_scripts.Side(redis, step_scripts.revision_sources("HEAD"))
            await side.start(16)
            await side.round(8)  # the first call of each script loads it (NOSCRIPT), one by one
            await redis.config_resetstat()
            for _ in range(2):
                await side.round(8)
            stats = await redis.info("commandstats")
            assert stats["cmdstat_evalsha"]["calls"] == 2 * 2  # one enqueue batch and one commit batch a round
            assert stats["cmdstat_xadd"]["calls"] == 2 * 8 * 2  # an inbox entry and a reply per step
            steps = [int(await redis.hget(side.keys.session(sid), "committed_step_id")) for sid in side.sessions]
            assert sorted(steps) == [0] * 8 + [1] * 8  # 24 steps over 16 sessions, in order
        finally:
            await redis.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize(("entry", "fields"), [("full", 6), ("packed", 3)])
async def test_the_xadd_enqueue_side_runs_no_enqueue_script_and_its_commits_land(entry: str, fields: int) -> None:
    """--xadd-enqueue's side: one plain XADD per step instead of the enqueue script, entries that the
    real commit script accepts (their epoch and generation the session's), every step committed."""
    with private_redis() as server:
        redis = open_redis(server.url, decode_responses=False)
        try:
            side = step_scripts.Side(redis, None, xadd_enqueue=entry)
            await side.start(16)
            inbox = side.keys.inbox(step_scripts.WORKER)
            await side._xadd(side.sessions[:1])  # the entry as written, then taken out before any round
            [(entry_id, written)] = await redis.xrange(inbox)
            assert len(written) == fields and written[b"session_id"] == side.sessions[0].encode()
            assert await redis.xdel(inbox, entry_id) == 1
            await side.round(8)
            await redis.config_resetstat()
            for _ in range(2):
                await side.round(8)
            stats = await redis.info("commandstats")
            assert stats["cmdstat_evalsha"]["calls"] == 2  # the commit batches alone
            assert stats["cmdstat_xadd"]["calls"] == 2 * 8 * 2  # the inbox entry (plain) and the reply per step
            steps = [int(await redis.hget(side.keys.session(sid), "committed_step_id")) for sid in side.sessions]
            assert sorted(steps) == [0] * 8 + [1] * 8
        finally:
            await redis.aclose()


@pytest.mark.asyncio
async def test_both_sides_measure_the_same_steps() -> None:
    rows = await step_scripts.measure("smoke", "HEAD", 4)
    sides = [row for row in rows if row.system.startswith("scripts @")]
    assert [row.system for row in sides] == ["scripts @ this checkout", "scripts @ HEAD"]
    assert sides[0].values["steps"] == sides[1].values["steps"] > 0
    assert all(row.values["scripts_us"] > 0 and row.values["main_thread_us"] > 0 for row in sides)
    assert rows[-1].system == "this checkout / HEAD" and rows[-1].values["scripts"] > 0
    rows = await step_scripts.measure("smoke", "HEAD", 4, xadd_enqueue="full")
    assert [row.system for row in rows] == ["scripts @ this checkout", "scripts @ xadd enqueue",
                                            "this checkout / xadd enqueue"]
    assert rows[0].values["steps"] == rows[1].values["steps"] > 0


def test_a_revision_that_does_not_exist_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        step_scripts.revision_sources("no-such-revision")
    assert "cannot read prelude.lua at 'no-such-revision'" in str(exc.value)
    assert step_scripts.main(["--batch", "0"]) == 2
    assert "--batch must be at least 1" in capsys.readouterr().err
    assert step_scripts.main(["--xadd-enqueue", "--baseline", "HEAD"]) == 2
    assert "--xadd-enqueue compares with this checkout, not with --baseline" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_callgrind_counts_the_same_instructions_for_the_same_scripts(tmp_path: Path) -> None:
    """Under callgrind both sides run the same Lua: their counts agree to well under a percent
    (a timed run of the same pair swings by several), and the parts add up."""
    rows = await step_scripts.measure("smoke", "HEAD", 4, Callgrind(str(tmp_path), step_scripts.FUNCTIONS))
    this, base, ratio = (row.values for row in rows)
    for side in (this, base):
        assert side["total"] > side["scripts"] > side["commands_in_scripts"] > 0
        assert side["scripts_own"] == pytest.approx(side["scripts"] - side["commands_in_scripts"])
        assert side["outside_scripts"] == pytest.approx(side["total"] - side["scripts"])
    assert ratio["scripts"] == pytest.approx(1.0, abs=0.01)
