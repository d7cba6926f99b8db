"""The issue's targets, read off the measured rows: met or missed, and by how much.

This reports; it never fails a run. A target whose rows are absent (``--only``) is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.common import Row

Key = tuple[str, str, str]  # (bench, case, system)
Measured = dict[Key, dict[str, float]]
Measure = Callable[[Measured], float | None]


@dataclass(frozen=True)
class Target:
    name: str
    goal: float
    higher_is_better: bool
    measure: Measure
    text: str


def _get(key: Key, metric: str) -> Measure:
    return lambda by: by.get(key, {}).get(metric)


def _ratio(num: Key, den: Key, metric: str) -> Measure:
    def measure(by: Measured) -> float | None:
        a, b = by.get(num, {}).get(metric), by.get(den, {}).get(metric)
        return a / b if a is not None and b else None

    return measure


def _targets() -> list[Target]:
    rt, tp, tr = "round_trip", "throughput", "transport"
    out = [
        Target("round trip tiny x1: http p50 / fleet p50", 1.0, True,
               _ratio((rt, "tiny x1", "http"), (rt, "tiny x1", "fleet"), "p50"), ">= 1 (no slower than HTTP)"),
        Target("round trip tiny x64: http p50 / fleet p50", 1.0, True,
               _ratio((rt, "tiny x64", "http"), (rt, "tiny x64", "fleet"), "p50"), ">= 1 (no slower than HTTP)"),
        Target("round trip tiny x64: fleet p99 ms", 5.0, False, _get((rt, "tiny x64", "fleet"), "p99"), "<= 5 ms"),
        Target("round trip latent x1: http p50 / fleet p50", 3.0, True,
               _ratio((rt, "latent x1", "http"), (rt, "latent x1", "fleet"), "p50"), ">= 3x faster"),
        Target("round trip latent x64: http p50 / fleet p50", 3.0, True,
               _ratio((rt, "latent x64", "http"), (rt, "latent x64", "fleet"), "p50"), ">= 3x faster"),
    ]
    for workers in (1, 2, 4):
        case = f"{workers} workers x 256 sessions"
        out += [Target(f"throughput {workers}w: fleet / arq", 10.0, True,
                       _ratio((tp, case, "fleet"), (tp, case, "arq"), "steps_s"), ">= 10x"),
                Target(f"throughput {workers}w: fleet / streaq", 15.0, True,
                       _ratio((tp, case, "fleet"), (tp, case, "streaq"), "steps_s"), ">= 15x")]
    for shape in ("(1, 16, 2, 44, 80)", "(1, 16, 8, 44, 80)"):
        key = (tr, f"{shape} f32", "codec vs base64-json")
        out += [Target(f"transport {shape}: base64-json time / codec time", 15.0, True, _get(key, "speedup"),
                       ">= 15x faster"),
                Target(f"transport {shape}: codec smaller than base64-json, %", 25.0, True, _get(key, "smaller_pct"),
                       ">= 25% smaller"),
                Target(f"transport {shape}: codec encode+decode / memcpy", 1.5, False, _get(key, "codec_x_memcpy"),
                       "<= 1.5x one memcpy")]
    out.append(Target("batch fill: % of engine ceiling", 95.0, True,
                      _get(("batch_fill", "64 sessions", "fleet (1 worker)"), "fill_pct"), ">= 95%"))
    return out


def evaluate(rows: Sequence[Row]) -> list[Row]:
    """One row per target whose inputs were measured: system 'met' or 'missed'."""
    by = {(r.bench, r.case, r.system): r.values for r in rows}
    out: list[Row] = []
    for target in _targets():
        value = target.measure(by)
        if value is None:
            continue
        met = value >= target.goal if target.higher_is_better else value <= target.goal
        short = (target.goal / value if target.higher_is_better else value / target.goal) if value else float("inf")
        note = f"target {target.text}" + ("" if met else f"; missed by {short:.2f}x")
        out.append(Row("targets", target.name, "met" if met else "MISSED",
                       {"measured": value, "target": target.goal}, "", note))
    return out
