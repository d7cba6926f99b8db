"""The fleet simulation's figures: per step (token, latent) and per worker-second (idle), per master.

``*_net`` figures are the window's less the idle window's rate over the same time: what the steps
themselves cost, apart from heartbeats, blocked reads and reaping, which grow with the number of
workers and not with the step rate (docs/sizing.md adds both back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.redis_meter import ClusterMeter, Master, Usage, combined

TOP_COMMANDS = 8  # commands per step listed in the markdown table


@dataclass
class Window:
    """What one measured window saw: Redis per master, processes' CPU, steps per cell."""

    kind: str
    seconds: float
    meter: ClusterMeter
    worker_cpu_s: float = 0.0
    trainer_cpu_s: float = 0.0
    steps: dict[str, int] | None = None
    errors: int = 0
    first_error: str = ""


def _workers_on(master: Master, placed: Mapping[str, Master], per_cell: Mapping[str, int]) -> int:
    return sum(per_cell[cell] for cell, m in placed.items() if m.name == master.name)


def _rounded(values: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


def idle_report(idle: Window, placed: Mapping[str, Master], per_cell: Mapping[str, int]) -> dict[str, Any]:
    """What a fleet costs before it runs a step: per worker and second, and per master and second
    (a master spends CPU on its cron and the cluster bus with no client at all)."""
    workers = sum(per_cell.values())
    masters = {m.name: m for m in placed.values()}
    return {
        "seconds": round(idle.seconds, 3),
        "per_master_s": {name: _rounded(used.per(idle.seconds)) for name, used in idle.meter.used.items()},
        "per_worker_s": _rounded(combined(idle.meter.used.values()).per(workers * idle.seconds)),
        "commands_per_worker_s": _rounded(combined(idle.meter.used.values()).commands_per(workers * idle.seconds)),
        "masters": {name: _rounded(idle.meter.used[name].per(_workers_on(m, placed, per_cell) * idle.seconds))
                    for name, m in masters.items()},
        "worker_cpu_us_per_worker_s": round(1e6 * idle.worker_cpu_s / (workers * idle.seconds), 3),
    }


def _net(window: Window, idle: Window, name: str) -> Usage:
    return window.meter.used[name].minus(idle.meter.used[name], window.seconds / idle.seconds)


def steps_report(window: Window, idle: Window, placed: Mapping[str, Master]) -> dict[str, Any]:
    steps = window.steps or {}
    total = sum(steps.values())
    per_master: dict[str, Any] = {}
    for name in window.meter.used:
        cells = [cell for cell, m in placed.items() if m.name == name]
        count = sum(steps[cell] for cell in cells)
        per_master[name] = {"cells": {cell: steps[cell] for cell in cells}, "steps": count,
                            "steps_s": round(count / window.seconds, 1),
                            "per_step": _rounded(window.meter.used[name].per(count)),
                            "per_step_net": _rounded(_net(window, idle, name).per(count))}
    gross = combined(window.meter.used.values())
    net = combined(_net(window, idle, name) for name in window.meter.used)
    idle_worker_cpu = idle.worker_cpu_s * window.seconds / idle.seconds
    return {
        "seconds": round(window.seconds, 3), "steps": total, "steps_s": round(total / window.seconds, 1),
        "errors": window.errors, "first_error": window.first_error,
        "per_step": _rounded(gross.per(total)), "per_step_net": _rounded(net.per(total)),
        "commands_per_step": _rounded(gross.commands_per(total)),
        "usec_per_step": _rounded(gross.usec_per(total)),
        "worker_cpu_us": round(1e6 * window.worker_cpu_s / total, 1) if total else None,
        "worker_cpu_us_net": round(1e6 * (window.worker_cpu_s - idle_worker_cpu) / total, 1) if total else None,
        "trainer_cpu_us": round(1e6 * window.trainer_cpu_s / total, 1) if total else None,
        "masters": per_master,
    }


def build(config: Mapping[str, Any], url: str, placed: Mapping[str, Master], per_cell: Mapping[str, int],
          windows: Sequence[Window], workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    idle = windows[0]
    report: dict[str, Any] = {
        "config": dict(config), "redis_url": url,
        "cells": {cell: {"master": m.name, "workers": per_cell[cell]} for cell, m in placed.items()},
        "idle": idle_report(idle, placed, per_cell),
        "engine_items": sum(int(w.get("engine_items", 0)) for w in workers),
    }
    for window in windows[1:]:
        report[window.kind] = steps_report(window, idle, placed)
    return report


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


PER_STEP = ("commands", "main_cpu_us", "cpu_us", "net_in_bytes", "net_out_bytes")


def markdown(report: Mapping[str, Any]) -> str:
    """Per step, by kind and master (gross / net of the idle floor), then the busiest commands."""
    c = report["config"]
    out = [f"fleet_sim: {c['workers']} workers, {c['sessions']} token + {c['latent_sessions']} latent sessions, "
           f"{len(report['cells'])} cells on {len({v['master'] for v in report['cells'].values()})} masters", "",
           "| kind | master | steps/s | " + " | ".join(f"{k}/step" for k in PER_STEP) + " |",
           "|---|---|---|" + "---|" * len(PER_STEP)]
    for kind in ("token", "latent"):
        if kind not in report:
            continue
        k = report[kind]
        rows = [(name, m["steps_s"], m["per_step"], m["per_step_net"]) for name, m in k["masters"].items()]
        for name, rate, gross, net in [*rows, ("cluster", k["steps_s"], k["per_step"], k["per_step_net"])]:
            cells = " | ".join(f"{_fmt(gross.get(f))} / {_fmt(net.get(f))}" for f in PER_STEP)
            out.append(f"| {kind} | {name} | {_fmt(rate)} | {cells} |")
    idle = report["idle"]["per_worker_s"]
    out += ["", "gross / net: net is less the idle window's rate. Idle, per worker and second: "
            + ", ".join(f"{f} {_fmt(idle.get(f))}" for f in PER_STEP)
            + f", worker CPU µs {_fmt(report['idle']['worker_cpu_us_per_worker_s'])}", "",
            "| kind | worker CPU µs/step (net) | trainer CPU µs/step | errors | busiest commands per step |",
            "|---|---|---|---|---|"]
    for kind in ("token", "latent"):
        if kind in report:
            k = report[kind]
            top = ", ".join(f"{cmd} {n:.2f}" for cmd, n in list(k["commands_per_step"].items())[:TOP_COMMANDS])
            out.append(f"| {kind} | {_fmt(k['worker_cpu_us'])} ({_fmt(k['worker_cpu_us_net'])}) | "
                       f"{_fmt(k['trainer_cpu_us'])} | {k['errors']} | {top} |")
    return "\n".join(out)
