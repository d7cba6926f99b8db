"""The benchmark suite runs end to end at smoke size. Benchmarks are not tests: no speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import run_all


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
