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


def _fleet_systems(by: Measured, bench: str, case: str) -> list[str]:
    """"fleet", each "fleet (N trainers)" and "fleet (one hop)" measured for this case."""
    return [system for (b, c, system) in by if b == bench and c == case
            and (system in ("fleet", "fleet (one hop)")
                 or (system.startswith("fleet (") and system.endswith(" trainers)")))]


def _with(system: str, anchor: str) -> str:
    """The anchor run with as many trainer processes as ``system`` (bench.throughput.system_name)."""
    return anchor + system[len("fleet"):]


def _targets(by: Measured) -> list[Target]:
    """The issue's targets, each a ratio of two rows of the same run."""
    rt, tp, tr = "round_trip", "throughput", "transport"
    out: list[Target] = []
    for workers in (1, 2, 4):
        case = f"{workers} workers x 256 sessions"
        for fleet in _fleet_systems(by, tp, case):
            out += [Target(f"throughput {workers}w, {fleet}: fleet / arq steps/s", 10.0, True,
                           _ratio((tp, case, fleet), (tp, case, _with(fleet, "arq")), "steps_s"), ">= 10x"),
                    Target(f"throughput {workers}w, {fleet}: fleet / streaq steps/s", 15.0, True,
                           _ratio((tp, case, fleet), (tp, case, _with(fleet, "streaq")), "steps_s"), ">= 15x")]
    for n in (1, 64):
        for fleet in _fleet_systems(by, rt, f"latent x{n}"):
            out.append(Target(f"latent x{n}, {fleet}: http p50 / fleet p50", 3.0, True,
                              _ratio((rt, f"latent x{n}", "http"), (rt, f"latent x{n}", fleet), "p50"),
                              ">= 3x faster than the HTTP server"))
    for fleet in _fleet_systems(by, rt, "tiny x64"):
        out.append(Target(f"tiny x64, {fleet}: fleet p99 / p99 of 64 concurrent PINGs", 3.0, False,
                          _ratio((rt, "tiny x64", fleet), (rt, "floor x64", "redis PING"), "p99"), "<= 3x"))
    for shape in ("(1, 16, 2, 44, 80)", "(1, 16, 8, 44, 80)"):
        key = (tr, f"{shape} f32", "codec vs base64-json")
        out += [Target(f"transport {shape}: codec encode+decode / memcpy", 1.5, False, _get(key, "codec_x_memcpy"),
                       "<= 1.5x one memcpy"),
                Target(f"transport {shape}: base64-json time / codec time", 15.0, True, _get(key, "speedup"),
                       ">= 15x faster"),
                Target(f"transport {shape}: codec smaller than base64-json, %", 25.0, True, _get(key, "smaller_pct"),
                       ">= 25% smaller")]
    out.append(Target("batch fill: % of engine ceiling", 95.0, True,
                      _get(("batch_fill", "64 sessions", "fleet (1 worker)"), "fill_pct"), ">= 95%"))
    return out


def evaluate(rows: Sequence[Row]) -> list[Row]:
    """One row per target whose inputs were measured: system 'met' or 'missed'."""
    by = {(r.bench, r.case, r.system): r.values for r in rows}
    out: list[Row] = []
    for target in _targets(by):
        value = target.measure(by)
        if value is None:
            continue
        met = value >= target.goal if target.higher_is_better else value <= target.goal
        # factor: how far past the goal (met) or short of it (missed), as a ratio >= 1
        ratio = value / target.goal if target.higher_is_better else target.goal / value if value else float("inf")
        factor = ratio if met else (1.0 / ratio if ratio else float("inf"))
        note = f"target {target.text}; " + (f"met by {factor:.2f}x" if met else f"missed by {factor:.2f}x")
        out.append(Row("targets", target.name, "met" if met else "MISSED",
                       {"measured": value, "target": target.goal, "factor": factor}, "", note))
    return out
