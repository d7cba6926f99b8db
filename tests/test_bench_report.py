"""The benchmark report: targets read off the rows of one run, and the markdown section that
``bench.run_all --markdown`` writes into docs/benchmarks.md. No benchmark runs here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report
from bench.common import Row
from bench.targets import evaluate
from bench.throughput import median_row, ratios
from bench.trainers import split, window_values

CASE = "1 workers x 256 sessions"


def _rows() -> list[Row]:
    return [
        Row("throughput", CASE, "fleet", {"steps_s": 2000.0}),
        Row("throughput", CASE, "arq", {"steps_s": 400.0}),
        Row("throughput", CASE, "streaq", {"steps_s": 100.0}),
        Row("throughput", CASE, "fleet (4 trainers)", {"steps_s": 4000.0}),
        Row("throughput", CASE, "arq (4 trainers)", {"steps_s": 800.0}),
        Row("round_trip", "floor x64", "redis PING", {"p99": 10.0}),
        Row("round_trip", "tiny x64", "fleet", {"p99": 40.0}),
        Row("round_trip", "tiny x64", "fleet (4 trainers)", {"p99": 20.0}),
        Row("batch_fill", "64 sessions", "fleet (1 worker)", {"fill_pct": 96.0}),
    ]


def _targets() -> dict[str, Row]:
    return {row.case: row for row in evaluate(_rows())}


def test_each_target_compares_rows_of_the_same_trainer_count() -> None:
    targets = _targets()
    one = targets["throughput 1w, fleet: fleet / arq steps/s"]
    four = targets["throughput 1w, fleet (4 trainers): fleet / arq steps/s"]
    assert (one.system, one.values["measured"], one.values["factor"]) == ("MISSED", 5.0, 2.0)
    assert (four.values["measured"], four.note) == (5.0, "target >= 10x; missed by 2.00x")
    assert targets["throughput 1w, fleet: fleet / streaq steps/s"].system == "met"
    # no streaq row with 4 trainers: that target is left out rather than compared across counts
    assert "throughput 1w, fleet (4 trainers): fleet / streaq steps/s" not in targets


def test_the_latency_target_is_a_ratio_to_the_ping_floor() -> None:
    targets = _targets()
    one = targets["tiny x64, fleet: fleet p99 / p99 of 64 concurrent PINGs"]
    four = targets["tiny x64, fleet (4 trainers): fleet p99 / p99 of 64 concurrent PINGs"]
    assert (one.system, one.values["measured"], one.note) == ("MISSED", 4.0, "target <= 3x; missed by 1.33x")
    assert (four.system, four.values["measured"], four.note) == ("met", 2.0, "target <= 3x; met by 1.50x")
    assert targets["batch fill: % of engine ceiling"].system == "met"


def _report() -> dict[str, object]:
    return {"command": "python -m bench.run_all --size full", "started": 0.0, "elapsed_s": 300.0,
            "wall_s": {"throughput": 120.0}, "failed": [], "loadavg": {"start": 2.5, "end": None},
            "machine": {"nproc": 2, "cpu": "AMD EPYC", "platform": "Linux", "python": "3.11.7",
                        "redis": "Redis server v=7.0.15"}}


def test_the_markdown_states_the_machine_the_load_and_every_verdict() -> None:
    rows = _rows()
    text = report.markdown(_report(), rows + evaluate(rows))
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert "- load average (1 min) at the start / end: 2.50 / unknown" in text
    assert "`python -m bench.run_all --size full`" in text and "2 CPUs (AMD EPYC)" in text
    assert "| throughput 1w, fleet: fleet / arq steps/s | 5.00 | >= 10x | **missed by 2.00x** |" in text
    assert "| batch fill: % of engine ceiling | 96.00 | >= 95% | met (1.01x to spare) |" in text
    assert "| throughput | 1 workers x 256 sessions | fleet (4 trainers) | steps_s=4000 |" in text


def test_writing_replaces_only_the_marked_section(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\n{report.BEGIN}\nold table\n{report.END}\n\n## History\nkept\n", encoding="utf-8")
    report.write(page, f"{report.BEGIN}\nnew table\n{report.END}")
    assert page.read_text(encoding="utf-8") == (
        f"# Benchmarks\n\n{report.BEGIN}\nnew table\n{report.END}\n\n## History\nkept\n")
    plain = tmp_path / "run.md"
    report.write(plain, "just this")
    assert plain.read_text(encoding="utf-8") == "just this\n"


@pytest.mark.parametrize(("total", "parts", "expected"), [(64, 4, [16] * 4), (256, 3, [86, 85, 85]), (1, 2, [1])])
def test_sessions_are_split_over_trainers_evenly(total: int, parts: int, expected: list[int]) -> None:
    assert split(total, parts) == expected


def test_window_values_add_the_trainers_steps_and_cpu() -> None:
    children = [{"steps_s": 100.0, "errors": 0.0, "cpu_us_client": 300.0},
                {"steps_s": 300.0, "errors": 1.0, "cpu_us_client": 100.0}]
    values = window_values(children, window_s=2.0)
    # 200 + 600 steps; CPU 0.06 s + 0.06 s over 800 steps = 150 us per step
    assert values == {"steps_s": 400.0, "errors": 1.0, "cpu_us_client": pytest.approx(150.0)}


def test_a_throughput_cell_is_the_median_of_its_windows_with_the_spread_of_side_by_side_ratios() -> None:
    def window(steps: float, cpu: float) -> Row:
        return Row("throughput", "256 sessions", "", {"steps_s": steps, "cpu_us_client": cpu})

    fleet = median_row([window(9000.0, 100.0), window(6000.0, 140.0), window(8000.0, 110.0)])
    arq = median_row([window(1000.0, 900.0), window(500.0, 950.0), window(800.0, 910.0)])
    assert fleet.values["steps_s"] == 8000.0 and fleet.values["cpu_us_client"] == 110.0
    assert (fleet.values["steps_s_lo"], fleet.values["steps_s_hi"], fleet.values["repeats"]) == (6000.0, 9000.0, 3.0)
    fleet.system, arq.system = "fleet", "arq"
    fleet.case = arq.case = CASE
    windows = {("fleet", CASE): [9000.0, 6000.0, 8000.0], ("arq", CASE): [1000.0, 500.0, 800.0]}
    [row] = ratios([fleet, arq], (1,), windows)
    assert row.values == {"arq": 10.0, "arq_lo": 9.0, "arq_hi": 12.0}  # 9000/1000, 6000/500, 8000/800
    assert median_row([window(5.0, 1.0)]).values == {"steps_s": 5.0, "cpu_us_client": 1.0}  # one window: no spread
