"""The benchmark suite runs end to end at smoke size. Benchmarks are not tests: no speed is asserted."""

from __future__ import annotations

import json
import subprocess
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_step_cpu_measures_this_checkout_beside_a_worktree_of_a_revision() -> None:
    from bench import step_cpu

    rows = step_cpu.run("smoke", "HEAD")
    systems = {(row.case.split()[0], row.system) for row in rows}
    assert systems == {(case, system) for case in ("tiny", "latent")
                       for system in ("fleet @ this checkout", "fleet @ HEAD", "this checkout / HEAD")}
    for row in rows:
        if row.system.startswith("fleet @"):
            assert row.values["steps_s"] > 0 and row.values["cpu_us_total"] > 0, row
    worktrees = subprocess.run(["git", "-C", str(step_cpu.REPO), "worktree", "list"], capture_output=True,
                               text=True, check=True).stdout
    assert "step-cpu-" not in worktrees  # the temporary checkout is gone
