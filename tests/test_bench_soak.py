"""The soak benchmark at a smoke size: the fleet runs under its load, samples are taken and written.
A soak asserts no growth (it is read from its table and plot, docs/soak.md); nor does this test."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from bench import soak

PROCESSES = ("worker0", "supervisor", "gateway", "trainer", "http_client", "redis")
REDIS_SERIES = ("redis.used_memory_mb", "redis.keys", "redis.inbox_entries", "redis.reply_entries",
                "redis.dead_letters", "redis.stats_entries", "redis.log_keys", "redis.log_fields")


@pytest.mark.slow
@pytest.mark.timeout(600)  # reference workers import torch; a loaded 2-core machine
def test_soak_samples_every_process_and_redis_and_writes_them(tmp_path: Path) -> None:
    out, png = tmp_path / "soak", tmp_path / "soak.png"
    code = soak.main(["--minutes", "0.4", "--interval", "3", "--workers", "1", "--trainer-lanes", "2",
                      "--http-lanes", "1", "--out", str(out), "--plot", str(png), "--quiet"])
    assert code == 0
    with open(out / "samples.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) >= 3
    expected = [f"{kind}.{name}" for name in PROCESSES for kind in ("rss_mb", "fds")] + list(REDIS_SERIES)
    for row in rows:  # every sample read every process (a number, not a gone process's NaN) and Redis
        for name in expected:
            assert float(row[name]) >= 0, (name, row[name])
    report = json.loads((out / "soak.json").read_text(encoding="utf-8"))
    assert len(report["samples"]) == len(rows)
    assert set(expected) <= set(report["growth"])
    last = report["samples"][-1]
    assert last["load.trainer_steps"] > 0 and last["load.http_steps"] > 0, report["first_errors"]
    assert last["load.trainer_sessions"] > 0  # sessions turn over: created, stepped and closed
    assert png.stat().st_size > 0


def test_growth_per_hour_fits_the_second_half() -> None:
    """A series flat in its first half and rising 1 per second in its second grows 3600 per hour;
    a flat one 0; too few finite samples give NaN."""
    times = [float(t) for t in range(0, 101)]
    values = [0.0 if t < 50 else t - 50.0 for t in times]
    assert soak.growth_per_hour(times, values) == pytest.approx(3600.0)
    assert soak.growth_per_hour(times, [5.0] * len(times)) == pytest.approx(0.0)
    assert math.isnan(soak.growth_per_hour([0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]))
